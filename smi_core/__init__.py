"""smi: fundamental limits of learning sequence multi-index models and deep attention."""
from derive.attention import index_symbols

from .models import DeepAttention, LinkModel, Mixing, Reparametrisation, SMIModel, register_link
from .series import ExactEvaluation, LargeDepthSeries, SeriesEvaluation

__all__ = ["DeepAttention", "ExactEvaluation", "LargeDepthSeries", "LinkModel", "Mixing",
           "Reparametrisation", "SMIModel", "SeriesEvaluation", "index_symbols", "register_link"]
