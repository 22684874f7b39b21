"""The prompts jspec measures a drafter's acceptance and its step costs on when nothing better is known:
``jspec.auto`` choosing a drafter, the server's load adaptation at warm-up (``jspec.tools.serve_cmd``)."""

# Calibration prompts: openings of functions in the Python standard library (the bundled model's training
# source, held-out files or not: it only sets the acceptance estimate). Not HumanEval, which evaluates.
CALIBRATION_PROMPTS = (
    "def _splitext(p, sep, altsep, extsep):\n    \"\"\"Split the extension from a pathname.",
    "class Counter(dict):\n    '''Dict subclass for counting hashable items.",
    "def dedent(text):\n    \"\"\"Remove any common leading whitespace from every line in `text`.",
    "import os\nimport sys\n\n\ndef main(args=None):\n    parser = argparse.ArgumentParser(",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__,",
    "def isabs(s):\n    \"\"\"Test whether a path is absolute\"\"\"\n    s = os.fspath(s)\n",
    "class Queue:\n    '''Create a queue object with a given maximum size.\n\n    If maxsize is <= 0,",
    "def commonprefix(m):\n    \"Given a list of pathnames, returns the longest common leading component\"\n",
)
