"""`python tests/helpers/syncbn_driver.py TRAIN-FLAGS...`: the command line (python -m dptrain train)
with one extra model, `resnet18-tiny` (resnet18 at widths 8-8-8-8), so a data-parallel
sync-BN run finishes in seconds on a CPU. Used by test_sync_bn.py under mpirun."""
import sys

from dptrain.cli import main as cli_main
from dptrain.nn import MODELS, resnet18


def resnet18_tiny(image_shape, num_classes):
    return resnet18(image_shape, num_classes, widths=(8, 8, 8, 8))


if __name__ == "__main__":
    MODELS["resnet18-tiny"] = resnet18_tiny
    sys.exit(cli_main(["train", *sys.argv[1:]]))
