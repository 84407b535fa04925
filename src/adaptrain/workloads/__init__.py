"""Real-data workloads shared by the examples, the demo, tests and benchmarks."""

from adaptrain.workloads.charlm import (
    VOCAB,
    VOCAB_SIZE,
    CharLM,
    CharLMDataset,
    charlm_datasets,
    decode,
    encode,
    stdlib_text,
)
from adaptrain.workloads.charlm import loss as charlm_loss
from adaptrain.workloads.digits import NUM_CLASSES, DigitsNet, digits_datasets, digits_loss

__all__ = [
    "VOCAB",
    "VOCAB_SIZE",
    "CharLM",
    "CharLMDataset",
    "charlm_datasets",
    "charlm_loss",
    "decode",
    "encode",
    "stdlib_text",
    "NUM_CLASSES",
    "DigitsNet",
    "digits_datasets",
    "digits_loss",
]
