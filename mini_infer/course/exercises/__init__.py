"""Each chapter's exercise checks, one module per chapter (`mini-infer grade` runs them)."""
