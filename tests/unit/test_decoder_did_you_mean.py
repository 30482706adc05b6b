"""A misspelled decoder (or any choice of a sampling option) gets a did-you-mean: on the
command line (argparse's invalid choice, exit 2) and in a served request (HTTP 400,
OpenAI's error body) or a config (resolve_sampling)."""

import pytest

from unmask.cli import main
from unmask.errors import InputError
from unmask.sampling.config import resolve_sampling
from unmask.serve.protocol import CompletionRequest, RequestError, sampling_config


def test_the_command_line_names_the_decoder_meant(capsys):
    argv = ["generate", "--model", "unused", "--prompt", "x", "--decoder", "joint_treshold"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unmask: error: argument --decoder: invalid choice: "
                          "'joint_treshold' (did you mean 'joint_threshold'?) (choose from ")  # fmt: skip
    assert main([*argv[:-1], "zzz"]) == 2  # nothing close: argparse's line as it was
    assert "did you mean" not in capsys.readouterr().err


def test_a_request_and_a_config_name_the_decoder_meant():
    request = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "unmask": {"decoder": "entropy_bond"}})  # fmt: skip
    with pytest.raises(RequestError) as caught:
        sampling_config(request, {}, 8)
    assert caught.value.status == 400
    assert "unknown decoder 'entropy_bond' (did you mean 'entropy_bound'?)" in str(caught.value)
    with pytest.raises(InputError, match=r"unknown remasking 'low_confidnce' \(did you mean "
                                         r"'low_confidence'\?\)"):  # fmt: skip
        resolve_sampling({"remasking": "low_confidnce"})
