"""Recipe models: a small name registry (``create_model`` / ``list_models``) over four families."""

from recipes.models.acoustic import CTCAcousticModel
from recipes.models.lm import CausalLM
from recipes.models.registry import create_model, list_models, register_model
from recipes.models.resnet import ResNet
from recipes.models.seq2seq import Seq2SeqTransformer

__all__ = ["CTCAcousticModel", "CausalLM", "ResNet", "Seq2SeqTransformer", "create_model", "list_models",
           "register_model"]
