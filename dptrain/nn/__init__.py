"""Modules, layers and models.

May import: dptrain.backend, dptrain.engine (and the face: errors, fileio).
"""
from dptrain.nn.layers import (
    AvgPool2d, Conv2d, Dropout, Flatten, Identity, Linear, MaxPool2d, ReLU, Sequential, Sigmoid,
    Tanh,
)
from dptrain.nn.containers import ModuleDict, ModuleList
from dptrain.nn.models import MODELS, build_model, cnn, mlp
from dptrain.nn.module import Module, Parameter
from dptrain.nn.attention import MultiHeadAttention
from dptrain.nn.transformer import GELU, LayerNorm, TransformerEncoderLayer
from dptrain.nn.vit import VisionTransformer, vit
from dptrain.nn.norm import BatchNorm1d, BatchNorm2d, sync_batch_norm
from dptrain.nn.pooling import AdaptiveAvgPool2d
from dptrain.nn.resnet import BasicBlock, Bottleneck, ResNet, resnet18, resnet34, resnet50

__all__ = [
    "Module", "Parameter", "Linear", "Conv2d", "MaxPool2d", "AvgPool2d", "ReLU", "Flatten",
    "Dropout", "Sequential", "ModuleList", "ModuleDict", "Identity", "Sigmoid", "Tanh",
    "MODELS", "build_model", "cnn", "mlp",
    "MultiHeadAttention", "LayerNorm", "GELU", "TransformerEncoderLayer", "VisionTransformer",
    "vit",
    "BatchNorm1d", "BatchNorm2d", "sync_batch_norm", "AdaptiveAvgPool2d", "BasicBlock",
    "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50",
]
