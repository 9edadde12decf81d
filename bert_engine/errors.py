"""The engine's one error for bad user input, in a leaf module so every layer can raise it (the plugin
contract re-exports it: `bert_engine.hookspecs.InputError`)."""


class InputError(ValueError):
    """The documented error for bad user input (empty text, no [MASK], a value out of range).

    Tasks raise it from `preprocess`; the playground shows its message, never a stack trace.
    """
