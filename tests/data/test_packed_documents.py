"""Packed documents (--reset-position-ids, --reset-attention-mask, --eod-mask-loss): the
positions, documents and loss mask a micro-batch carries, against a plain loop over
Megatron's rule (get_ltor_masks_and_position_ids), and the flags' checks."""

from __future__ import annotations

import pytest
import torch

from megatron3d.config import DataConfig
from megatron3d.data.documents import Documents, check_document_flags
from megatron3d.data.sampler import micro_batches
from megatron3d.errors import ConfigError

EOD = 9
CPU = torch.device("cpu")


def _megatron_rule(row: list[int]) -> tuple[list[int], list[int]]:
    """(position ids, document ids) of one sample, element by element: after each EOD the
    positions restart at 0 and a new document begins; the EOD ends its own document."""
    positions, documents, position, document = [], [], 0, 0
    for token in row:
        positions.append(position)
        documents.append(document)
        position += 1
        if token == EOD:
            position, document = 0, document + 1
    return positions, documents


ROWS = {
    "no eod": [1, 2, 3, 4, 5, 6, 7, 8],
    "eod first": [EOD, 2, 3, 4, 5, 6, 7, 8],
    "eod last": [1, 2, 3, 4, 5, 6, 7, EOD],
    "eods in a row": [1, EOD, EOD, EOD, 5, 6, EOD, 8],
    "all eod": [EOD] * 8,
    "several": [1, 2, EOD, 4, 5, 6, EOD, 8],
}


@pytest.mark.parametrize("name", ROWS)
def test_positions_and_documents_follow_megatrons_rule(name):
    rows = torch.tensor([ROWS[name], ROWS["several"]])
    info = Documents(EOD, reset_position_ids=True, reset_attention_mask=True).token_info(rows)
    for b, row in enumerate(rows.tolist()):
        positions, documents = _megatron_rule(row)
        assert info.position_ids[b].tolist() == positions
        assert info.doc_ids[b].tolist() == documents
    assert info.index.tolist() == list(range(8))


def test_random_rows_follow_megatrons_rule():
    rows = torch.randint(0, 3, (16, 40), generator=torch.Generator().manual_seed(0))
    rows = torch.where(rows == 0, EOD, rows)  # a third of the tokens end a document
    info = Documents(EOD, reset_position_ids=True, reset_attention_mask=True).token_info(rows)
    for b, row in enumerate(rows.tolist()):
        assert (info.position_ids[b].tolist(), info.doc_ids[b].tolist()) == _megatron_rule(row)


def test_each_flag_gives_only_its_own_field():
    rows = torch.tensor([ROWS["several"]])
    assert Documents(EOD).token_info(rows) is None
    positions_only = Documents(EOD, reset_position_ids=True).token_info(rows)
    assert positions_only.doc_ids is None and positions_only.position_ids is not None
    documents_only = Documents(EOD, reset_attention_mask=True).token_info(rows)
    assert documents_only.position_ids is None and documents_only.doc_ids is not None


class _Fixed:
    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = torch.tensor(rows)

    def samples(self, start: int, count: int) -> torch.Tensor:
        return self.rows[start:start + count]


def test_micro_batches_carry_the_token_info_and_the_eod_loss_mask():
    """Computed from the inputs (not the labels): the EOD at the input's position gets no
    loss, and its document id is the one it ends."""
    data = _Fixed([[1, 2, EOD, 4, 5, 6, EOD, 8, 9], [EOD, 2, 3, 4, 5, 6, 7, 8, EOD]])
    rule = Documents(EOD, mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    batches = micro_batches(data, 0, 2, 1, 0, 1, CPU, rule)
    assert [mb.token_info.doc_ids.tolist() for mb in batches] == [
        [[0, 0, 0, 1, 1, 1, 1, 2]], [[0, 1, 1, 1, 1, 1, 1, 1]]]
    assert [mb.token_info.position_ids.tolist() for mb in batches] == [
        [[0, 1, 2, 0, 1, 2, 3, 0]], [[0, 0, 1, 2, 3, 4, 5, 6]]]
    assert batches[0].loss_mask.tolist() == [[1, 1, 0, 1, 1, 1, 0, 1]]
    assert batches[1].loss_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1]]
    plain = micro_batches(data, 0, 2, 2, 0, 1, CPU, Documents(EOD, mask_loss=True))
    assert plain[0].token_info is None and plain[0].loss_mask.tolist() == [
        [1, 1, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert micro_batches(data, 0, 2, 2, 0, 1, CPU)[0].loss_mask.min() == 1


@pytest.mark.parametrize("name", ["reset_position_ids", "reset_attention_mask",
                                  "eod_mask_loss"])
def test_mock_data_has_no_end_of_document_token(name):
    with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')}=True") as err:
        check_document_flags(DataConfig(mock_data=True, **{name: True}))
    assert "\n" not in str(err.value) and "--data-path" in str(err.value)
    check_document_flags(DataConfig(data_path=("d",), **{name: True}))
