"""Each chapter's exercise checks, one module per chapter (`mini-infer
grade` reads their verdicts)."""
