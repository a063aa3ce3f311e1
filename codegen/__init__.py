"""codegen: SymPy programs → C inside Cython.  ``doprint`` (text), ``generate`` (files),
``compile_module`` (build on demand), ``twin`` (the lambdify twin)."""
from .build import compile_module
from .generate import generate, render_all, render_module
from .printer import doprint
from .twin import expressions_twin, twin

__all__ = ["compile_module", "doprint", "generate", "render_all", "render_module", "twin", "expressions_twin"]
