"""The engine's one error for bad user input, in a leaf module so every layer can raise it (the plugin
contract re-exports it: `bert_engine.hookspecs.InputError`)."""

from __future__ import annotations


class InputError(ValueError):
    """The documented error for bad user input (empty text, no [MASK], a value out of range).

    Tasks raise it from `preprocess`; the playground shows its message, never a stack trace. For one
    input of a list, `InputError.at` says which: the batching layers (predict_in_batches, pipeline
    streams) renumber `position` to the caller's own list, which a task's preprocess never sees whole.
    """

    position: int | None = None  # which input of the list handed to preprocess (None: not about one input)
    detail: str = ""  # the message without the task and the position

    @classmethod
    def at(cls, task: str, position: int, detail: str) -> InputError:
        """The error "TASK: inputs[POSITION]: DETAIL" (a place in the caller's list, counted from 0 as Python's are:
        "input 2" read as the second), remembering the position and the detail."""
        err = cls(f"{task}: inputs[{position}]: {detail}")
        err.position, err.detail = position, detail
        return err
