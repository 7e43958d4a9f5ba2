"""LightningModules of the recipes (one per task)."""

from recipes.tasks.image_task import ImageClassifier
from recipes.tasks.language_task import LanguageModel
from recipes.tasks.speech_task import SpeechRecognizer
from recipes.tasks.translation_task import Translator

__all__ = ["ImageClassifier", "LanguageModel", "SpeechRecognizer", "Translator"]
