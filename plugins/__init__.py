"""Built-in task plugins, one module per task; they load through bert_engine.registry like any plugin."""
