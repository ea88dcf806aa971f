"""The course's site, built as the README says (tools/build_site.py), opened page by page in
headless Chromium from a local HTTP server: no console errors and nothing fetched from outside the
site, every stored figure present and decoded, no `#|` directive and no hidden cell's code on show,
every internal link and anchor resolves, the search answers. Screenshots of the landing page and of
chapter 2 go to tests/_output/site/ for a person to look at."""
import functools, json, re, shutil, threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urldefrag, urlparse
import pytest

ROOT = Path(__file__).parent.parent
SHOTS = ROOT / "tests" / "_output" / "site"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER = next(filter(None, map(shutil.which, BROWSERS)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium here: `apt-get install "
                                "chromium` (.ci/run installs it where it runs as root)")


def site_pages() -> list[str]:
    "The pages the site should have: one per notebook of the sidebar, in course order."
    import yaml
    sidebar = yaml.safe_load((ROOT / "nbs" / "sidebar.yml").read_text())["website"]["sidebar"]
    items = sidebar["contents"]
    names = [n for i in items for n in ([i] if isinstance(i, str) else i["contents"])]
    return ["index.html" if n == "index.ipynb" else n.replace(".ipynb", ".html") for n in names]


def shown_figures_and_hidden_lines(notebook: Path) -> tuple[int, list[str]]:
    """The PNG outputs of the cells the site shows, and from each `#| hide` cell its longest line
    that no shown cell has (so that finding it on the page means the hidden cell is on show)."""
    cells = json.loads(notebook.read_text())["cells"]
    hide = re.compile(r"^#\|\s*hide\s*$", re.M)
    hidden = lambda c: c["cell_type"] == "code" and hide.search("".join(c["source"]))
    shown_text = "\n".join("".join(c["source"]) for c in cells if not hidden(c))
    figures = sum("image/png" in o.get("data", {}) for c in cells if c["cell_type"] == "code"
                  and not hidden(c) for o in c.get("outputs", []))
    lines = []
    for c in filter(hidden, cells):
        own = [l.strip() for l in "".join(c["source"]).splitlines()
               if len(l.strip()) > 25 and not l.startswith("#|") and l.strip() not in shown_text]
        lines += [max(own, key=len)] if own else []
    return figures, lines


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    "The site built by tools/build_site.py, served on 127.0.0.1; its base URL and folder."
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "tools" / "build_site.py")
    spec.loader.exec_module(build_site := importlib.util.module_from_spec(spec))
    folder = build_site.build(tmp_path_factory.mktemp("site") / "_site").parent
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args): pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", folder
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=BROWSER, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()


def open_page(browser, url: str):
    "The page, loaded; and what went wrong: console and page errors, failed or outside requests."
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    host = urlparse(url).netloc
    page.on("request", lambda r: urlparse(r.url).netloc != host
            and problems.append(f"fetched from outside the site: {r.url}"))
    page.goto(url, wait_until="load")      # the page and its figures
    return page, problems


def test_every_page(site, browser):
    base, folder = site
    pages = site_pages()
    assert sorted(p.name for p in folder.glob("*.html")) == sorted(pages + ["404.html"])
    ids = {p: set(re.findall(r'\sid="([^"]+)"', (folder / p).read_text())) for p in pages}
    for name in pages:
        page, problems = open_page(browser, base + name)
        assert not problems, (name, problems)
        notebook = ROOT / "nbs" / name.replace(".html", ".ipynb")
        figures, hidden_lines = shown_figures_and_hidden_lines(notebook)
        images = page.eval_on_selector_all("article img", "els => els.map(e => "
                                           "[e.getAttribute('src'), e.complete, e.naturalWidth])")
        stored = [i for i in images if i[0].startswith("figures/")]
        assert len(stored) == figures, (name, len(stored), figures)
        assert all(done and width > 0 for _, done, width in images), (name, images)
        text = page.inner_text("article")
        pre = page.eval_on_selector_all("article pre", "els => els.map(e => e.innerText)")
        # a directive on show is a code line starting `#|` (the prose may name one)
        assert not re.search(r"^\s*#\|", "\n".join(pre), re.M), (name, "a directive shows")
        for line in hidden_lines:
            assert line not in text, (name, "a hidden cell shows", line)
        for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
            url, anchor = urldefrag(href)
            if not url.startswith(base):
                continue
            target = url[len(base):] or "index.html"
            assert (folder / target).is_file(), (name, "links to a missing page", href)
            if anchor and target in ids:
                assert anchor in ids[target], (name, "links to a missing anchor", href)
        page.close()


def test_landing_page_search_and_screenshots(site, browser):
    base, _ = site
    SHOTS.mkdir(parents=True, exist_ok=True)
    page, problems = open_page(browser, base + "index.html")
    nav = page.eval_on_selector_all("nav.md-nav--primary a.md-nav__link[href$='.html']",
                                    "els => els.map(e => e.getAttribute('href'))")
    chapters = [p for p in site_pages() if p != "index.html"]
    assert [h for h in dict.fromkeys(nav) if h in chapters] == chapters     # the course's order
    notation = page.locator("table", has_text="in the code").first
    assert notation.locator("math").count() >= 20      # the notation table, its symbols as math
    # Typed key by key, as a person types: Material reads the query on keyup, on focus and when its
    # search worker is ready, never on `input`. `page.fill` sends only `input`, so its text was read
    # only when the focus event happened to come after it (about one try in three here).
    page.locator("input.md-search__input").press_sequentially("paged attention")
    page.wait_for_selector(".md-search-result__item", timeout=20_000)
    assert page.locator(".md-search-result__item").count() > 0
    page.keyboard.press("Escape")
    page.screenshot(path=str(SHOTS / "index.png"))
    chapter, more = open_page(browser, base + "02_paged_cache.html")
    chapter.locator("article img[src^='figures/']").first.scroll_into_view_if_needed()
    chapter.screenshot(path=str(SHOTS / "02_paged_cache.png"))
    assert not problems + more, problems + more
    print(f"screenshots in {SHOTS}")
