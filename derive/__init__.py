"""derive: every model-specific formula, in SymPy (no numerics here)."""
from .attention import ARCHITECTURES, BETA, SKIP, AttentionSpec, forward_program, index_symbols, mixing_program
from .links import LINKS
from .program import Program, jacobian
from .registry import KernelSpec, LinkSpec, attention_kernels, link_kernels, pregenerated
from .reparam import reparam_program
from .series import DepthSeries, large_depth_series

__all__ = ["ARCHITECTURES", "BETA", "SKIP", "AttentionSpec", "KernelSpec", "LINKS", "LinkSpec",
           "DepthSeries", "Program", "attention_kernels", "forward_program", "index_symbols",
           "jacobian", "large_depth_series", "link_kernels", "mixing_program", "pregenerated",
           "reparam_program"]
