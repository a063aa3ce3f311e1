"""smi: fundamental limits of learning sequence multi-index models and deep attention."""
from derive.attention import index_symbols

from .models import DeepAttention, LinkModel, Mixing, Reparametrisation, SMIModel, register_link
from .series import ExactEvaluation, LargeDepthSeries, SeriesEvaluation
from .state_evolution import SEResult, free_entropy, learning_curve, state_evolution

__all__ = ["DeepAttention", "ExactEvaluation", "LargeDepthSeries", "LinkModel", "Mixing",
           "Reparametrisation", "SEResult", "SMIModel", "SeriesEvaluation", "free_entropy", "index_symbols",
           "learning_curve", "register_link", "state_evolution"]
