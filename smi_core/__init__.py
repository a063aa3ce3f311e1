"""smi: fundamental limits of learning sequence multi-index models and deep attention."""
from derive.attention import index_symbols

from .aim import (aim_data, aim_free_convolution, aim_gamp, aim_gd, aim_perfect_recovery,
                  aim_small_width, aim_state_evolution, aim_weak_recovery)
from .data import Teacher, make_teacher, sample
from .gamp import GAMPResult, gamp
from .models import DeepAttention, LinkModel, Mixing, Reparametrisation, SMIModel, register_link
from .series import ExactEvaluation, LargeDepthSeries, SeriesEvaluation
from .sgd import SGDResult, sgd
from .state_evolution import SEResult, free_entropy, learning_curve, state_evolution
from .thresholds import PhaseDiagram, Staircase, Threshold, phase_diagram, staircase, weak_recovery_threshold

__all__ = ["DeepAttention", "ExactEvaluation", "GAMPResult", "LargeDepthSeries", "LinkModel",
           "Mixing", "PhaseDiagram", "Reparametrisation", "SEResult", "SGDResult", "SMIModel",
           "SeriesEvaluation", "Staircase", "Teacher", "Threshold", "aim_data", "aim_free_convolution",
           "aim_gamp", "aim_gd", "aim_perfect_recovery", "aim_small_width", "aim_state_evolution",
           "aim_weak_recovery", "free_entropy", "gamp", "index_symbols", "learning_curve",
           "make_teacher", "phase_diagram", "register_link", "sample", "sgd", "staircase",
           "state_evolution", "weak_recovery_threshold"]
