"""Keep bitsandbytes out of every import but the one that needs it.

diffusers (its quantizers, via ``ModelMixin``) and peft (its QLoRA layers) import bitsandbytes whenever
it is installed, and the dev extras install it. On CPUs with AVX-512 BF16 (many GPU servers' hosts)
bitsandbytes' import then asks the Hugging Face hub for a 4-bit CPU kernel (through the ``kernels``
package when that is installed) and, failing, logs a warning to stderr. So every ``train.py`` and
``sample.py`` printed a line first, and could reach for the network.

Nothing here uses quantized layers; only ``train.optimizer=adamw_8bit`` needs bitsandbytes. So
importing ``dit`` hides bitsandbytes (a ``None`` in ``sys.modules`` makes ``importlib.util.find_spec``
answer "not installed", which is how diffusers and peft ask), and ``import_bitsandbytes`` un-hides it
for the optimizer, with the hub lookup switched off and its warning kept off stderr.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType

NAME = "bitsandbytes"
_hidden = False  # whether the None in sys.modules is ours (a test may put its own there)


def hide_bitsandbytes() -> None:
    """Make bitsandbytes look absent to diffusers and peft, unless something already imported it.

    Not once diffusers or peft is imported: they decide at their own import whether bitsandbytes is
    there, and one that was told so would fail importing it later (``None`` in ``sys.modules``). A
    script that imports diffusers before this project keeps diffusers' own behaviour instead."""
    global _hidden
    if NAME not in sys.modules and "diffusers" not in sys.modules and "peft" not in sys.modules:
        sys.modules[NAME] = None
        _hidden = True


def import_bitsandbytes() -> ModuleType:
    """bitsandbytes itself, imported offline and quietly; ImportError when it is not installed."""
    global _hidden
    if _hidden and NAME in sys.modules and sys.modules[NAME] is None:
        del sys.modules[NAME]
    _hidden = False
    # ``kernels`` set to None: bitsandbytes' ``from kernels import get_kernel`` fails at once instead of
    # downloading; the warning it then logs goes to a logger held at ERROR for the import.
    blocked_kernels = "kernels" not in sys.modules
    if blocked_kernels:
        sys.modules["kernels"] = None
    logger = logging.getLogger(NAME)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        logger.setLevel(level)
        if blocked_kernels:
            del sys.modules["kernels"]
    return bitsandbytes
