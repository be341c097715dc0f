"""Two attention paths over one set of mask functions (trainer/masks.py).

- ``flex_compiled``: torch.compile'd flex_attention with a BlockMask. The GPU path:
  fused kernel, memory linear in the sequence length.
- ``sdpa``: scaled_dot_product_attention with the dense boolean mask rendered from
  the same mask_mod. The CPU path (tests, demo): flex_attention has no backward on
  CPU, and the dense mask is fine at tiny sizes.
- ``flex_eager``: flex_attention without compile. It materialises the full score
  matrix (7 GB at S=8192), so on a GPU it exists only behind ``compile.allow_eager``
  (debugging); on CPU it is used by tests to check the BlockMask numerically.

Every drafter forward records its layers' attention calls per path in a
process-wide counter (``paths_ran``, via ``record_attention``) that the training
loop reports, so a run that silently left the fused path shows it.
"""

from __future__ import annotations

import importlib.util
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflashctl.core import contract
from trainer.config import ConfigError, compile_problems
from trainer.torch_api import forget_flex_fallback_warning
from trainer.masks import CAUSAL_IN_BLOCK, build_block_mask, dense_mask

FLEX_COMPILED = "flex_compiled"
FLEX_EAGER = "flex_eager"
SDPA = "sdpa"

EAGER_FALLBACK_MESSAGE = "flex_attention called without torch.compile"

# Created once for the process: every drafter layer and thread shares its cache
# entries (one per device x length bucket), so warm-up covers them all.
_flex_compiled = torch.compile(flex_attention, dynamic=False)

# flex_attention's backward tiles measured fastest on the DFlash mask at head dim 128 in
# bf16 on an H200 (bench.trainer.flex: -10 % backward against torch's defaults;
# bench/RESULTS.md). Tied to Hopper's shared memory: used there only, for 16-bit inputs
# of head dim <= 128 (``compile.flex_kernel``).
HOPPER_BWD_TILES = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 8, "bwd_num_stages": 2}
# flash-attention 4's CuTe kernels behind flex_attention (torch's experimental FLASH backend;
# the flash-attn-4 package): ``compile.flex_kernel: flash``, and ``auto`` where ``flash_usable``.
FLASH_OPTIONS = {"BACKEND": "FLASH"}
# The compute capabilities flash-attention 4's kernels are built for: Hopper, Blackwell (datacenter).
FLASH_CAPABILITIES = (9, 10)
# torch's lowering of flex_attention to those kernels (``kernel_options={"BACKEND": "FLASH"}``).
FLASH_LOWERING = "torch._inductor.kernel.flex.flex_flash_attention"
FLEX_KERNELS = ("auto", "triton", "default", "flash")

_ran: Counter = Counter()
_ran_lock = threading.Lock()


@dataclass(frozen=True)
class AttentionPath:
    name: str  # FLEX_COMPILED, FLEX_EAGER or SDPA
    device_type: str  # 'cuda' or 'cpu'
    mask_builder: str = "direct"
    """How the flex paths build BlockMasks: one of masks.MASK_BUILDERS (costs in the
    masks module docstring). FLEX_EAGER compiles nothing, so it builds 'compiled' eagerly."""
    hopper_tiles: bool = False
    """Compiled flex_attention with HOPPER_BWD_TILES (16-bit, head dim <= 128) instead of torch's defaults."""
    flash: bool = False
    """Compiled flex_attention on flash-attention 4's CuTe kernels (FLASH_OPTIONS; 16-bit, head
    dim <= 128: other calls take torch's defaults, since the tiles above fit only that range too)."""
    why: str = field(default="", compare=False)
    """The setting that chose the kernels and, for ``auto``, why (for ``describe``)."""

    @property
    def uses_block_mask(self) -> bool:
        return self.name != SDPA

    def describe(self) -> str:
        """The path and, compiled, which kernels it runs and why, in words (the trainer's
        start-up line): 'flex_compiled: flex_attention on flash-attention 4's kernels
        (flash-attn-4 4.0.0b36; compile.flex_kernel auto)'."""
        if self.name != FLEX_COMPILED:
            return self.name
        if self.flash:
            kernels = "flash-attention 4's kernels"
        else:
            kernels = f"its own Triton kernels, {'Hopper tiles' if self.hopper_tiles else 'default tiles'}"
        return f"{self.name}: flex_attention on {kernels}" + (f" ({self.why})" if self.why else "")


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def flash_usable(device: Union[str, torch.device]) -> Optional[str]:
    """Why flex_attention cannot run on flash-attention 4's kernels on ``device``; None: it can.

    It can on a Hopper or Blackwell GPU (compute capability 9 or 10) with flash-attn-4 at
    a release whose backward is sound (``contract.flash_attn_problem``) and a torch whose
    inductor lowers flex_attention to it (``FLASH_LOWERING``).
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in FLASH_CAPABILITIES:
        return f"the GPU is not Hopper or Blackwell (compute capability {major}.{minor})"
    version = installed_version(contract.FLASH_ATTN_PACKAGE)
    unsafe = contract.flash_attn_problem(version)
    if unsafe:
        return unsafe
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return f"{contract.FLASH_ATTN_PACKAGE} {version} is installed, but flash_attn.cute is not importable"
    if importlib.util.find_spec(FLASH_LOWERING) is None:
        return f"torch {torch.__version__} has no FLASH backend for flex_attention"
    return None


def select_attention_path(
    device: Union[str, torch.device],
    enabled: str = "auto",
    allow_eager: bool = False,
    mask_builder: str = "direct",
    flex_kernel: str = "auto",
) -> AttentionPath:
    """The path for ``compile.enabled`` on ``device``; ConfigError for a refused combination.

    auto: cuda -> flex_compiled, cpu -> sdpa. on: flex_compiled (GPU only: no
    flex backward on CPU). off: sdpa on CPU; on a GPU the dense flex path, which
    is refused unless ``allow_eager`` (trainer/compile.py, rule 5). ``flex_kernel``
    (``compile.flex_kernel``): triton uses flex_attention's own Triton kernels, with
    HOPPER_BWD_TILES on a compute capability 9 GPU; default the same with torch's
    default tiles; flash flash-attention 4's kernels (refused where ``flash_usable``
    says why not); auto flash where it is usable, else triton.
    """
    device_type = torch.device(device).type
    if enabled not in ("auto", "on", "off"):
        raise ConfigError([f"compile.enabled: {enabled!r} is not one of 'auto', 'on', 'off'"])
    if flex_kernel not in FLEX_KERNELS:
        raise ConfigError([f"compile.flex_kernel: {flex_kernel!r} is not one of {', '.join(FLEX_KERNELS)}"])
    refused = compile_problems(enabled, device_type, allow_eager)
    if refused:
        raise ConfigError(refused)
    if device_type == "cpu":
        return AttentionPath(SDPA, device_type)
    if enabled == "off":
        return AttentionPath(FLEX_EAGER, device_type, mask_builder)
    refuse_eager_fallback()
    hopper = (flex_kernel != "default" and device_type == "cuda" and torch.cuda.is_available()
              and torch.cuda.get_device_capability(device)[0] == 9)
    if flex_kernel not in ("auto", "flash"):
        return AttentionPath(FLEX_COMPILED, device_type, mask_builder, hopper_tiles=hopper,
                             why=f"compile.flex_kernel {flex_kernel}")
    why_not = flash_usable(device)
    if why_not is None:
        version = installed_version(contract.FLASH_ATTN_PACKAGE)
        return AttentionPath(FLEX_COMPILED, device_type, mask_builder, hopper_tiles=hopper, flash=True,
                             why=f"{contract.FLASH_ATTN_PACKAGE} {version}; compile.flex_kernel {flex_kernel}")
    if flex_kernel == "flash":
        raise ConfigError([f"compile.flex_kernel: 'flash' refused: {why_not}; it needs a Hopper or Blackwell GPU "
                           f"and '{contract.FLASH_ATTN_SPEC}' "
                           "(pip install flash-attn-4); use 'auto' or 'triton' for flex_attention's own kernels"])
    return AttentionPath(FLEX_COMPILED, device_type, mask_builder, hopper_tiles=hopper,
                         why=f"compile.flex_kernel auto: {why_not}")


def refuse_eager_fallback() -> None:
    """Make flex_attention's "called without torch.compile" warning an error.

    Dynamo runs a frame uncompiled when it hits the recompile limit; the only sign
    is that warning, and torch shows it once per process. Clearing torch's
    shown-once record (a private set; skipped if it moves) makes it fire, and so
    raise, on the next fallback too.
    """
    warnings.filterwarnings("error", message=EAGER_FALLBACK_MESSAGE)
    forget_flex_fallback_warning()


@dataclass
class LayerMasks:
    """The masks of one batch, one per layer type present, in the path's format."""

    path: AttentionPath
    full: Optional[Union[BlockMask, torch.Tensor]] = None
    sliding: Optional[Union[BlockMask, torch.Tensor]] = None

    def for_layer(self, layer_type: str) -> Union[BlockMask, torch.Tensor]:
        mask = self.full if layer_type == "full" else self.sliding
        if mask is None:
            raise ValueError(f"no mask was built for '{layer_type}' layers")
        return mask


def build_layer_masks(
    path: AttentionPath,
    anchors_BN: torch.Tensor,
    valid_BN: torch.Tensor,
    ctx_len: int,
    block_size: int,
    layer_types: list[str],
    window: int,
    semantics: str = CAUSAL_IN_BLOCK,
) -> LayerMasks:
    """One mask per layer type; sliding layers by ``semantics`` (masks.SLIDING_SEMANTICS)."""
    masks = LayerMasks(path)
    for layer_type in sorted(set(layer_types)):
        w = window if layer_type == "sliding" else None
        if path.uses_block_mask:
            builder = path.mask_builder
            if builder == "compiled" and path.name != FLEX_COMPILED:
                builder = "eager"
            mask = build_block_mask(anchors_BN, valid_BN, ctx_len, block_size, w, semantics, builder=builder)
        else:
            mask = dense_mask(anchors_BN, valid_BN, ctx_len, block_size, w, semantics)
        setattr(masks, layer_type, mask)
    return masks


def attend(
    q_BHQD: torch.Tensor,
    k_BHKD: torch.Tensor,
    v_BHKD: torch.Tensor,
    mask: Union[BlockMask, torch.Tensor],
    path: AttentionPath,
) -> torch.Tensor:
    """Masked GQA attention; rows that see no key come out as zeros on every path."""
    if path.name == SDPA:
        # The math kernel's safe softmax gives zeros for fully masked rows, like flex.
        out_BHQD = F.scaled_dot_product_attention(q_BHQD, k_BHKD, v_BHKD, attn_mask=mask, enable_gqa=True)
    elif path.name == FLEX_COMPILED:
        # Both measured for 16-bit inputs up to head dim 128 only: the tiles need more shared
        # memory for fp32 or wider heads, flash-attention 4 was checked here in that range only.
        measured = q_BHQD.shape[-1] <= 128 and q_BHQD.dtype in (torch.bfloat16, torch.float16)
        options = None
        if measured:
            options = FLASH_OPTIONS if path.flash else HOPPER_BWD_TILES if path.hopper_tiles else None
        out_BHQD = _flex_compiled(q_BHQD, k_BHKD, v_BHKD, block_mask=mask, enable_gqa=True, kernel_options=options)
    elif path.name == FLEX_EAGER:
        # Chosen deliberately (allow_eager, CPU checks), so not an error here; torch
        # must still warn the next time, should a compiled call fall back.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=EAGER_FALLBACK_MESSAGE)
            out_BHQD = flex_attention(q_BHQD, k_BHKD, v_BHKD, block_mask=mask, enable_gqa=True)
        forget_flex_fallback_warning()
    else:
        raise ValueError(f"unknown attention path {path.name!r}")
    return out_BHQD


def record_attention(path: AttentionPath, calls: int) -> None:
    """Count ``calls`` attention calls on ``path`` (for metrics). Kept out of
    ``attend`` so that a compiled layer traces without a break at the lock."""
    with _ran_lock:
        _ran[path.name] += calls


def paths_ran() -> dict[str, int]:
    """Attention calls per path since start (or the last reset), for metrics."""
    with _ran_lock:
        return dict(_ran)


def reset_paths_ran() -> None:
    with _ran_lock:
        _ran.clear()
