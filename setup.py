"""Compile the committed kernels in generated/ (one extension module per .pyx, OpenMP)."""
import platform
import sys
from pathlib import Path

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP = {"extra_compile_args": ["-O3", "-fopenmp"], "extra_link_args": ["-fopenmp"]}


class ParallelBuildExt(build_ext):
    """Build the extension modules in parallel (one compiler per core)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = True


# the generated kernels' rows loops vectorise over samples (built where they run: -march=native),
# calling glibc's vector exp and log (libmvec, x86-64 Linux) where -fno-math-errno lets them
MVEC = platform.machine() == "x86_64" and sys.platform.startswith("linux")
KERNELS = {"extra_compile_args": OPENMP["extra_compile_args"] + ["-march=native", "-fno-math-errno"]
           + ["-DSMI_MVEC"] * MVEC, "extra_link_args": OPENMP["extra_link_args"] + ["-lmvec"] * MVEC}
extensions = [Extension(f"generated.{p.stem}", [str(p)], **KERNELS)
              for p in sorted(Path("generated").glob("*.pyx"))]
# the channel's moment sums vectorise with the host's vector unit (built where it runs: pip install);
# -fno-trapping-math lets the vectoriser turn the clamp of smi_exp_neg into a select
extensions.append(Extension("smi_core._quadrature", ["smi_core/_quadrature.pyx"],
                            extra_compile_args=OPENMP["extra_compile_args"]
                            + ["-march=native", "-fno-trapping-math"],
                            extra_link_args=OPENMP["extra_link_args"]))
setup(ext_modules=cythonize(extensions, language_level=3, nthreads=2, quiet=True),
      cmdclass={"build_ext": ParallelBuildExt})
