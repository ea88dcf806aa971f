"""Build the course's site into _site/, offline, with one command: `python tools/build_site.py`.

Each notebook, nbs/index.ipynb first and then the chapters and appendices in nbs/sidebar.yml's
order, becomes a markdown page the way nbdev's processing would make it: `#| hide` cells dropped,
`#| export` code shown with the module it goes to, `#| gpu` cells marked, the `#|` lines removed,
the collapsed setup cell folded, stored outputs kept and PNG figures written beside the page. Math
becomes MathML here, at build time. MkDocs with the Material theme then renders the pages, with
navigation in course order and a client-side search. Nothing is loaded from outside the site (no
web fonts, no CDN scripts, no badge images), so it reads offline and tests/test_site.py can hold
every page to no console errors. Quarto, nbdev's own renderer, installs from no registry:
nbs/_quarto.yml stays for readers who have it (`nbdev-preview`)."""
import base64, json, logging, re, shutil, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS, SITE = ROOT / "nbs", ROOT / "_site"
REPO = "https://github.com/mini-infer/mini-infer"
_DIRECTIVE = re.compile(r"^#\|\s*(.*?)\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def course_order() -> list[tuple[str | None, list[str]]]:
    "(section title or None, [notebook names]) in nbs/sidebar.yml's order."
    import yaml

    sections = []
    for item in yaml.safe_load((NBS / "sidebar.yml").read_text())["website"]["sidebar"]["contents"]:
        if isinstance(item, str):
            sections.append((None, [item]))
        else:
            sections.append((item["section"], list(item["contents"])))
    return sections


def page_name(notebook: str) -> str:
    return "index.md" if notebook == "index.ipynb" else notebook.replace(".ipynb", ".md")


# ---- markdown cells ----
def to_mathml(tex: str, display: bool) -> str:
    "LaTeX as MathML, safe inside markdown (tables and emphasis)."
    from latex2mathml.converter import convert

    tex = re.sub(r"\\arg(?![A-Za-z])", r"\\operatorname{arg}", tex)  # the converter lacks \arg
    try:
        mathml = convert(tex, display="block" if display else "inline")
    except Exception as e:  # say which formula, not only where in the converter
        raise ValueError(f"the site cannot write ${tex}$ as MathML: {e!r}") from e
    if unknown := re.search(r">(\\[A-Za-z]+)<", mathml):  # a command the converter left as text
        raise ValueError(f"the site cannot write ${tex}$ as MathML: {unknown[1]} is unknown")
    return mathml.replace("|", "&#124;").replace("*", "&#42;").replace("_", "&#95;")


_MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$\w])\$(?=\S)([^$\n]+?)(?<=\S)\$(?![\w$])", re.S)
_CODE = re.compile(r"(```.*?```|`[^`\n]+`)", re.S)  # fenced blocks and code spans: no math there


def math_to_mathml(text: str) -> str:
    parts = _CODE.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _MATH.sub(lambda m: to_mathml(m[1] or m[2], display=m[1] is not None), parts[i])
    return "".join(parts)


def fix_links(text: str) -> str:
    """Links between notebooks become links between pages; external images (the Colab and Kaggle
    badges) become their text, so that no page loads anything from outside the site."""
    text = re.sub(r"!\[([^\]]*)\]\(https?://[^)]+\)", r"\1", text)
    return re.sub(r"\]\((?:nbs/)?([\w-]+)\.ipynb(#[\w-]+)?\)",
                  lambda m: f"]({page_name(m[1] + '.ipynb')}{m[2] or ''})", text)


def markdown_cell(source: str) -> str:
    source = source.replace("<details>", '<details markdown="1">')
    return math_to_mathml(fix_links(source))


# ---- code cells ----
def fenced(text: str, lang: str = "") -> str:
    "`text` in a fenced block whose fence is longer than any backtick run inside it."
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def outputs_markdown(outputs: list, figures: "Figures") -> list[str]:
    "A code cell's stored outputs: text as text blocks, PNG figures as images, HTML as is."
    parts = []
    for out in outputs:
        data = out.get("data", {})
        if out["output_type"] == "stream":
            parts.append(fenced(_ANSI.sub("", "".join(out["text"])), "text"))
        elif "image/png" in data:
            parts.append(f"![figure]({figures.save(data['image/png'])})")
        elif "text/html" in data:
            parts.append('<div class="cell-html">' + "".join(data["text/html"]) + "</div>")
        elif "text/plain" in data:
            parts.append(fenced(_ANSI.sub("", "".join(data["text/plain"])), "text"))
    return parts


def indented(block: str) -> str:
    return "\n".join("    " + line if line else "" for line in block.splitlines())


def exported_to(directives: list[str], module: str | None) -> str | None:
    "The module an `#| export` (`exporti`, `exports`) cell goes to: named, else the notebook's."
    for d in directives:
        words = d.split()
        if words[0] in ("export", "exporti", "exports"):
            return words[1] if len(words) > 1 else module
    return None


def code_cell(cell: dict, module: str | None, figures: "Figures") -> str | None:
    """A code cell as markdown, None for a cell the site does not show (`#| hide`, or nothing left
    once the directives are removed). `#| echo: false` shows the outputs alone."""
    lines = "".join(cell["source"]).splitlines()
    directives = [m[1] for m in map(_DIRECTIVE.match, lines) if m]
    code = "\n".join(l for l in lines if not _DIRECTIVE.match(l)).strip("\n")
    title = None
    if code.startswith("#@title "):  # Colab's collapsed setup cell: folded, under its title
        title, _, code = code.removeprefix("#@title ").partition("\n")
    if "hide" in directives or not code.strip():
        return None
    parts = outputs_markdown(cell.get("outputs", []), figures)
    if "echo: false" not in directives:
        parts.insert(0, fenced(code, "python"))
    if module := exported_to(directives, module):
        parts.insert(0, f'<p class="exported">exported to <code>mini_infer.{module}</code></p>')
    body = "\n\n".join(parts)
    if title:
        return f'??? note "{title.strip()}"\n\n{indented(body)}'
    if "gpu" in directives:
        return f'!!! gpu "GPU cell: runs where CUDA is, skips elsewhere"\n\n{indented(body)}'
    return body


class Figures:
    "Stored PNG outputs, written as files beside the pages: figures/<page>-<n>.png."

    def __init__(self, docs: Path, page: str):
        self.folder, self.page, self.count = docs / "figures", page.removesuffix(".md"), 0
        self.folder.mkdir(exist_ok=True)

    def save(self, png_base64: str | list) -> str:
        self.count += 1
        name = f"figures/{self.page}-{self.count}.png"
        (self.folder.parent / name).write_bytes(base64.b64decode("".join(png_base64)))
        return name


def notebook_page(path: Path, docs: Path) -> str:
    "A notebook as one markdown page."
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    found = [re.search(r"^#\|\s*default_exp\s+(\S+)", s, re.M) for s in sources]
    module = next((m[1] for m in found if m), None)
    figures, parts = Figures(docs, page_name(path.name)), []
    for cell in cells:
        if cell["cell_type"] == "markdown":
            parts.append(markdown_cell("".join(cell["source"])))
        elif (md := code_cell(cell, module, figures)) is not None:
            parts.append(md)
    return "\n\n".join(parts) + "\n"


# ---- the site ----
def page_title(path: Path) -> str:
    "A notebook's title in the navigation: its first heading as plain text ('Home' for index)."
    if path.name == "index.ipynb":
        return "Home"
    first = "".join(json.loads(path.read_text())["cells"][0]["source"])
    return re.match(r"#\s+(.+)", first)[1].replace("`", "").strip()


def mkdocs_config(docs: Path, site: Path) -> dict:
    nav = []
    for section, notebooks in course_order():
        pages = [{page_title(NBS / nb): page_name(nb)} for nb in notebooks]
        nav += pages if section is None else [{section: pages}]
    return {
        "site_name": "mini-infer",
        "site_url": "https://mini-infer.github.io/mini-infer/",
        "site_description": "A teaching-first LLM inference engine, built chapter by chapter.",
        "docs_dir": str(docs),
        "site_dir": str(site),
        "use_directory_urls": False,  # 01_model.html: works from a plain file server
        "strict": True,  # a broken link between pages or to an anchor fails the build
        "validation": {"links": {"not_found": "warn", "anchors": "warn",
                                 "unrecognized_links": "warn"}},
        "theme": {"name": "material", "font": False,  # no web fonts: nothing from outside the site
                  "features": ["navigation.sections", "navigation.footer", "search.highlight",
                               "content.code.copy", "toc.follow"]},
        "plugins": ["search"],
        "extra_css": ["site.css"],
        "markdown_extensions": [
            "tables", "md_in_html", "admonition", "pymdownx.details", "pymdownx.superfences",
            {"pymdownx.highlight": {"use_pygments": True}}, {"toc": {"permalink": True}},
        ],
        "nav": nav + [{"Source on GitHub": REPO}],
    }


CSS = """.md-typeset .exported { font-size: .7rem; margin: 0 0 -.6rem;
  color: var(--md-default-fg-color--light); }
.md-typeset .admonition.gpu { border-color: #7b1fa2; }
.md-typeset .gpu > .admonition-title { background-color: #7b1fa21a; }
.md-typeset .gpu > .admonition-title::before { background-color: #7b1fa2; }
.md-typeset .cell-html { overflow-x: auto; }
"""


def build(site: Path = SITE) -> Path:
    "Write the site to `site` (_site/); return its index.html."
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        for _, notebooks in course_order():
            for nb in notebooks:
                (docs / page_name(nb)).write_text(notebook_page(NBS / nb, docs))
        (docs / "site.css").write_text(CSS)
        config_file = Path(tmp) / "mkdocs.yml"
        config_file.write_text(json.dumps(mkdocs_config(docs, site)))  # JSON is YAML
        shutil.rmtree(site, ignore_errors=True)
        mkdocs_build(load_config(str(config_file)))
    return site / "index.html"


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    print(f"wrote {build()}", file=sys.stderr)
