"""Attention-indexed models in the extensive-width regime (spec AIM.md)."""
from .channels import make_channel
from .closed_forms import (aim_perfect_recovery, aim_small_width, aim_weak_recovery,
                           hardmax_decay_constant)
from .data import aim_data
from .free_convolution import FreeConvolution, aim_free_convolution
from .gamp_rie import aim_gamp
from .gd import aim_gd
from .state_evolution import AIMSEResult, aim_state_evolution

__all__ = ["AIMSEResult", "FreeConvolution", "aim_data", "aim_free_convolution", "aim_gamp", "aim_gd",
           "aim_perfect_recovery",
           "aim_small_width", "aim_state_evolution", "aim_weak_recovery", "hardmax_decay_constant",
           "make_channel"]
