"""Model loading (GGUF, HF safetensors), the Llama-family model, tokenizer and chat templates."""

from tokenfleet.runtime.model.arch import ModelArch, RopeScaling
from tokenfleet.runtime.model.loader import LoadedModel, load_model
from tokenfleet.runtime.model.tokenizer import Tokenizer

__all__ = ["LoadedModel", "ModelArch", "RopeScaling", "Tokenizer", "load_model"]
