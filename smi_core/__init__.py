"""smi: fundamental limits of learning sequence multi-index models and deep attention."""
from derive.attention import index_symbols

from .models import DeepAttention, LinkModel, Mixing, Reparametrisation, SMIModel, register_link

__all__ = ["DeepAttention", "LinkModel", "Mixing", "Reparametrisation", "SMIModel",
           "index_symbols", "register_link"]
