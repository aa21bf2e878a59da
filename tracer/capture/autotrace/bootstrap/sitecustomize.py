"""ddpscope's bootstrap: ``ddpscope run`` puts this folder first on the ranks'
``PYTHONPATH``, so every Python process of the job imports it at start-up. It installs
the zero-code capture when ``$DDPSCOPE_CAPTURE`` is set (``tracer.capture.autotrace.install``:
nothing happens until torch's DDP module is imported), then runs the
``sitecustomize`` this file shadows, if there is one. It never stops the script.
"""

import os
import sys


def _install() -> None:
    if not os.environ.get("DDPSCOPE_CAPTURE"):
        return
    try:
        from ddpscope.tracer.capture.autotrace.install import install_from_env

        install_from_env()
    except Exception as e:  # noqa: BLE001 - the script runs, untraced
        print(f"ddpscope: tracing disabled: {type(e).__name__}: {e}", file=sys.stderr)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (the one this file shadows)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - as Python itself does for sitecustomize
        print(f"Error in sitecustomize ({spec.origin}): {type(e).__name__}: {e}", file=sys.stderr)


_install()
_chain()
