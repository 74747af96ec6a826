"""The demo takes what a user reaches for (--ranks, --max-tokens with T below it, --seed, --shape L,E,K or a
named shape) and refuses bad values with a usage error (status 2, argparse's message), not a traceback."""

import pytest

from jax_latent_ep.example import demo


def test_demo_takes_ranks_max_tokens_seed_and_a_custom_shape(capsys):
    assert demo.main(["--layers", "1", "--steps", "1", "--tokens", "2", "--max-tokens", "9", "--ranks", "2",
                      "--seed", "7", "--shape", "64,8,2", "--hidden", "64"]) == 0
    out = capsys.readouterr().out
    assert "2 x cpu devices" in out and "L=64 E=8 K=2" in out and "max_tokens 9, seed 7" in out, out


@pytest.mark.parametrize("argv,message", [
    (["--layers", "0"], "argument --layers: 0 must be at least 1"),
    (["--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["--tokens", "0"], "argument --tokens: 0 must be at least 1"),
    (["--tokens", "x"], "argument --tokens: 'x' is not an integer"),
    (["--tokens", "5", "--max-tokens", "4"], "--tokens 5 must not exceed --max-tokens 4"),
    (["--ranks", "3", "--shape", "64,8,2"], "--ranks 3 must be at most 32 and divide the 8 experts"),
    (["--ranks", "64"], "--ranks 64: only 8 cpu device"),
    (["--shape", "64,8"], "'64,8': give L,E,K"),
    (["--shape", "63,8,2"], "latent=63 must be a positive multiple of 32"),
])
def test_demo_refuses_bad_values_with_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err, err


def test_demo_deepseek_v3_shape_is_known():
    from jax_latent_ep.shapes import DEEPSEEK_V3

    assert demo._shape("deepseek_v3") == "deepseek_v3" and demo._shape("7168,256,8") == DEEPSEEK_V3
