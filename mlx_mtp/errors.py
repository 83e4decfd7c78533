"""User-facing errors: one line that names the file or flag and what was expected."""


class MTPError(ValueError):
    """Bad input from the user (a path, a checkpoint, a flag).

    The CLI prints ``str(err)`` on one line and exits non-zero, without a traceback.
    """
