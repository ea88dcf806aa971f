"""What the chapters teach with, not the engine: the exercise harness and grading,
each chapter's checks, teaching helpers and figures. The engine never imports it."""
