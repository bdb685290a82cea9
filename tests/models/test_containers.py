"""nn.ModuleList, nn.ModuleDict, nn.Identity, nn.Sigmoid, nn.Tanh, and the warning for layers
kept in a plain list or dict (not registered: never trained, exchanged or saved). Names follow
PyTorch's: ``layers.0.weight``, ``heads.name.weight``."""
import warnings

import numpy as np
import pytest

import dptrain as dp
import dptrain.engine.functional as F
from dptrain import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Tanh()])
        self.layers.append(nn.Linear(6, 5))
        self.heads = nn.ModuleDict({"cls": nn.Linear(5, 3)})
        self.heads["aux"] = nn.Sequential(nn.Identity(), nn.Linear(5, 2), nn.Sigmoid())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return {name: head(x) for name, head in self.heads.items()}


EXPECTED = {  # what torch.nn gives the same model
    "layers.0.weight": (6, 4), "layers.0.bias": (6,),
    "layers.2.weight": (5, 6), "layers.2.bias": (5,),
    "heads.cls.weight": (3, 5), "heads.cls.bias": (3,),
    "heads.aux.1.weight": (2, 5), "heads.aux.1.bias": (2,),
}


def test_state_dict_names_follow_pytorch():
    model = Net()
    state = model.state_dict()
    assert list(state) == list(EXPECTED)
    assert {k: v.shape for k, v in state.items()} == EXPECTED
    assert [n for n, _ in model.named_parameters()] == list(EXPECTED)
    assert len(model.parameters()) == len(EXPECTED)
    assert model.num_parameters() == sum(int(np.prod(s)) for s in EXPECTED.values())


def test_state_dict_round_trip():
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and np.array_equal(pa.numpy(), pb.numpy())


def test_forward_and_gradients_through_containers():
    model = Net()
    x = dp.tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    out = model(x)
    assert out["cls"].shape == (3, 3) and out["aux"].shape == (3, 2)
    aux = out["aux"].numpy()
    assert ((aux > 0) & (aux < 1)).all()  # sigmoid
    loss = F.cross_entropy(out["cls"], dp.tensor(np.array([0, 1, 2])))
    loss.backward()
    for name, p in model.named_parameters():
        if name.startswith(("layers.", "heads.cls.")):
            assert p.grad is not None and np.abs(p.grad.numpy()).sum() > 0, name


def test_activations_match_numpy():
    v = np.linspace(-3, 3, 7, dtype=np.float32)
    x = dp.tensor(v)
    np.testing.assert_allclose(nn.Tanh()(x).numpy(), np.tanh(v), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(nn.Sigmoid()(x).numpy(), 1 / (1 + np.exp(-v)), rtol=1e-6,
                               atol=1e-6)
    assert nn.Identity(3, flag=True)(x) is x


def test_module_list_behaves_as_a_list():
    a, b, c = nn.ReLU(), nn.Identity(), nn.Tanh()
    ml = nn.ModuleList([a])
    ml.extend([b, c])
    assert len(ml) == 3 and list(ml) == [a, b, c]
    assert ml[0] is a and ml[-1] is c
    assert list(ml[1:]) == [b, c]
    ml[1] = nn.Sigmoid()
    assert isinstance(ml[1], nn.Sigmoid)
    with pytest.raises(IndexError):
        ml[3]
    with pytest.raises(TypeError):
        ml.append(3)


def test_module_dict_behaves_as_a_dict():
    md = nn.ModuleDict([("items", nn.Identity()), ("b", nn.ReLU())])
    assert list(md) == list(md.keys()) == ["items", "b"]
    assert "items" in md and len(md) == 2
    assert isinstance(md["items"], nn.Identity)
    assert [type(v) for v in md.values()] == [nn.Identity, nn.ReLU]
    assert callable(md.items)  # a key cannot hide a method
    del md["b"]
    assert list(md) == ["items"]
    with pytest.raises(KeyError):
        md["a.b"] = nn.ReLU()


class Holder(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.value = value


@pytest.mark.parametrize("value", [[nn.Linear(2, 2)], (nn.ReLU(), nn.Linear(2, 2)),
                                   {"a": nn.Linear(2, 2)}])
def test_plain_container_of_layers_warns(value):
    with pytest.warns(UserWarning, match=r"Holder\.value .*nn\.ModuleList"):
        Holder(value)


@pytest.mark.parametrize("value", [[1, 2, 3], (3, 3), {"k": 1}, [], nn.ModuleList()])
def test_no_warning_for_plain_data_or_registered_containers(value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Holder(value)
