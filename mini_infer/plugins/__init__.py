"""Plug-ins (chapters 2b, 4-10): each implements a contract of `engine.contracts` and
registers under a name; the engine finds them through `engine.registry`, never imports them."""
