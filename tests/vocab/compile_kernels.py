"""Compile every Triton kernel of pgloss for a Hopper GPU (sm_90) on a machine without one. The compiler's front
end (`ASTSource.make_ir`, the first stage of `triton.compile`: where a kernel is typed) for each combination of a
kernel's compile-time flags, and the whole of `triton.compile`, down to a cubin, for each kernel with every flag on
at the widest tile the launch picks (`kernels.launch_shape`; the head-kernel route's at its GPU blocks,
`head_tile.gpu_blocks`, for a bfloat16 and a float32 head). Run as a script with TRITON_INTERPRET unset (the
interpreter never types a kernel); prints one JSON object: "compiled", {"kernel DTYPE FLAGS": "ok" or the
compiler's message}, and "pointers", {"kernel": the pointer additions (`tt.addptr`) of its IR with every flag on}.
`--broken` adds a kernel the compiler refuses and one whose row offsets are 32-bit, the harness's own checks.
Used by test_kernels_compile.py."""

import itertools
import json
import re
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource

from pgloss.vocab import backends, head_tile, head_tile_kernels, triton_kernels
from pgloss.vocab import kernels as route

TARGET = GPUTarget("cuda", 90, 32)
HEAD_DTYPES = tuple(
    {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype] for dtype in backends.KERNEL_DTYPES
)
"""the LM head's dtypes the kernel route takes, in Triton's names, cycled over a kernel's flag combinations"""
HEAD_POINTERS = {"R", "B", "R2", "B2", "X", "W"}  # the head's outputs, bias, hidden states and weight: its dtype
INDEX_POINTERS = {"TARGETS"}
BOOL_POINTERS = {"VALID"}
INTEGERS = {"stride", "stride2", "bias_stride", "bias_stride2", "target_stride", "width", "col0"} | {
    "x_stride",
    "w_stride",
    "dx_stride",
    "dw_stride",
    "n_rows",
    "hidden",
    "vocab",
    "split_width",
}
FLOATS = {"scale", "softcap", "scale2", "softcap2", "inv_t", "log_keep", "log_beta", "keep"}
# every other compile-time flag is a bool; the head-kernel route's blocks are those of a bfloat16 head on a GPU
HEAD_BLOCKS = dict(zip(("BLOCK_N", "BLOCK_V", "BLOCK_K"), head_tile.gpu_blocks(torch.bfloat16), strict=False))
FLAG_VALUES = {"MODE": (0, 1, 2), "BLOCK": (64,)} | {name: (value,) for name, value in HEAD_BLOCKS.items()}
WIDEST_BLOCK, WIDEST_WARPS = route.launch_shape(1 << 30)
CUBIN_HEADS = {"head_log_prob_entropy_forward": ("bf16", "fp32"), "head_log_prob_entropy_backward": ("bf16", "fp32")}
"""the heads each kernel is compiled to a cubin for (bf16 alone by default): tl.dot's IEEE float32 products too"""


def kernels(broken=False) -> dict:
    found = {
        name: value
        for module in (triton_kernels, head_tile_kernels)
        for name, value in vars(module).items()
        if isinstance(value, triton.runtime.jit.JITFunction) and not name.startswith("_")
    }
    if broken:
        found["broken"] = _broken
    return found


@triton.jit
def _two_return_types(x, FLAG: tl.constexpr):
    if FLAG:
        return x * 2.0, x
    return x, 1.0


@triton.jit
def _broken(X, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    x = tl.load(X + tl.arange(0, BLOCK))
    a, b = _two_return_types(x, FLAG)
    tl.store(X + tl.arange(0, BLOCK), a * b)


@triton.jit
def _rows_in_32_bits(R, stride, BLOCK: tl.constexpr):
    """A row offset the pointer check refuses: program id times stride in 32 bits (it wraps past 2³¹)."""
    row = R + tl.program_id(0) * stride
    tl.store(row + tl.arange(0, BLOCK), tl.load(row + tl.arange(0, BLOCK)) * 2.0)


def signature(kernel, flags: dict, head: str) -> dict:
    types = {}
    for name in (parameter.name for parameter in kernel.params):
        if name in flags:
            types[name] = "constexpr"
        elif name in HEAD_POINTERS:
            types[name] = f"*{head}"
        elif name in INDEX_POINTERS:
            types[name] = "*i64"
        elif name in BOOL_POINTERS:
            types[name] = "*i1"
        elif name.isupper():
            types[name] = "*fp32"
        elif name in INTEGERS:
            types[name] = "i32"
        elif name in FLOATS:
            types[name] = "fp32"
        else:
            raise LookupError(f"{kernel.fn.__name__}: the type of argument {name!r} is not known here")
    return types


def flag_combinations(kernel):
    names = [parameter.name for parameter in kernel.params if parameter.is_constexpr]
    for values in itertools.product(*(FLAG_VALUES.get(name, (False, True)) for name in names)):
        yield dict(zip(names, values, strict=True))


def source(kernel, flags: dict, head: str) -> ASTSource:
    names = [parameter.name for parameter in kernel.params]
    return ASTSource(
        kernel,
        signature(kernel, flags, head),
        constexprs={(names.index(name),): value for name, value in flags.items()},
    )


def front_end(kernel, flags: dict, head: str) -> str:
    """The kernel's IR (Triton's `tt` dialect) as text, without source locations."""
    backend = CUDABackend(TARGET)
    options = backend.parse_options({})
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = source(kernel, flags, head).make_ir(
        TARGET, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )
    return re.sub(r" loc\([^)]*\)", "", str(module))


def pointer_additions(kernel, flags: dict, head: str) -> list[str]:
    """Each `tt.addptr` of the kernel's IR: `%name = tt.addptr %base, %offset : base type, offset type`."""
    return [line.strip() for line in front_end(kernel, flags, head).splitlines() if "tt.addptr" in line]


def whole(kernel, flags: dict, head: str) -> None:
    """The kernel compiled to a cubin at the launch's widest tile (a row kernel) or its blocks for `head` (the
    head-kernel route's)."""
    if "BLOCK" in flags:
        flags, warps = {**flags, "BLOCK": WIDEST_BLOCK}, WIDEST_WARPS
    else:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[head]
        *sizes, warps = head_tile.gpu_blocks(dtype)
        flags = {**flags, **dict(zip(HEAD_BLOCKS, sizes, strict=True))}
    compiled = triton.compile(source(kernel, flags, head), target=TARGET, options={"num_warps": warps})
    assert compiled.asm["cubin"], "no cubin"


def outcome(step, *args) -> str:
    try:
        step(*args)
    except triton.compiler.errors.CompilationError as error:
        return " ".join(str(error).split())[-400:]
    return "ok"


def main(argv) -> None:
    results, pointers = {}, {}
    for name, kernel in kernels(broken="--broken" in argv).items():
        combinations = list(flag_combinations(kernel))
        for i, flags in enumerate(combinations):
            head = HEAD_DTYPES[i % len(HEAD_DTYPES)]
            label = " ".join([name, head, *(f"{k}={v}" for k, v in flags.items())])
            results[label] = outcome(front_end, kernel, flags, head)
        if name != "broken":
            for head in CUBIN_HEADS.get(name, ("bf16",)):
                label = f"{name} {head} every flag, compiled to a cubin"
                results[label] = outcome(whole, kernel, combinations[-1], head)
            pointers[name] = pointer_additions(kernel, combinations[-1], "bf16")
    if "--broken" in argv:
        pointers["broken rows in 32 bits"] = pointer_additions(_rows_in_32_bits, {"BLOCK": 64}, "fp32")
    print(json.dumps({"compiled": results, "pointers": pointers}))


if __name__ == "__main__":
    main(sys.argv[1:])
