"""Built-in task plugins, one module per task; they load through bert_engine.tasks.registry like any plugin.

A new built-in task is a module here and a line in BUILTIN; nothing in bert_engine changes.
"""

BUILTIN = ("plugins.sentiment", "plugins.ner", "plugins.qa", "plugins.summary", "plugins.fill_mask")
