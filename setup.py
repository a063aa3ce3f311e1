"""Compile the committed kernels in generated/ (one extension module per .pyx, OpenMP)."""
import runpy
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class ParallelBuildExt(build_ext):
    """Build the extension modules in parallel (one compiler per core)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = True


# the generated kernels: the flags codegen.build uses on demand too (loaded by path: no SymPy here)
compile_args, link_args = runpy.run_path("codegen/flags.py")["kernel_flags"]()
extensions = [Extension(f"generated.{p.stem}", [str(p)], extra_compile_args=compile_args,
                        extra_link_args=link_args)
              for p in sorted(Path("generated").glob("*.pyx"))]
# the channel's moment sums vectorise with the host's vector unit (built where it runs: pip install),
# with the kernels' flags (libmvec's cos and sin for the adaptive rule's polar points);
# -fno-trapping-math lets the vectoriser turn the clamp of smi_exp_neg into a select
extensions.append(Extension("smi_core._quadrature", ["smi_core/_quadrature.pyx"],
                            extra_compile_args=compile_args + ["-fno-trapping-math"],
                            extra_link_args=link_args))
setup(ext_modules=cythonize(extensions, language_level=3, nthreads=2, quiet=True),
      cmdclass={"build_ext": ParallelBuildExt})
