"""The step packet's writer (gradmon/capture/writer.py) on its own: what it packs, the
publisher's reader (statistics.read, read_scalars) reads back."""

from __future__ import annotations

import pytest
import torch

from gradmon import statistics as S
from gradmon.capture.records import _Records
from gradmon.capture.packet import StepPacket
from gradmon.capture.writer import write
from gradmon.errors import ErrorLog


def flow(*records):
    """GRAD_FLOW's records, committed: (layer, numel, norm, nan, inf) each."""
    r = _Records(keyed=False)
    for key, numel, norm, nan, inf in records:
        r.add(key, numel, (torch.tensor([norm]), torch.tensor([nan, inf])))
    r.commit()
    return r


def read(packet):
    values = packet.data.tolist()
    return ({st.name: (sec.keys, sec.numels, rows) for st, sec, rows in S.read(values, packet.sections)},
            S.read_scalars(values, packet.scalars))


def blank():
    return StepPacket(0, 1, 0.0)


def test_the_reader_reads_back_every_section_and_scalar_the_writer_packed():
    grad = (torch.tensor([[3.0, 0, 0], [4.0, 1, 0]]), (1, 0), (10, 20))
    packet = write(blank(), (S.GRAD, S.GRAD_FLOW), {"grad_flow": flow((2, 5, 1.5, 0, 0), (0, 7, 2.5, 0, 3))},
                   {"grad": grad}, None, [(S.SCALAR_LOSS, torch.tensor(0.25)), (S.SCALAR_AMP_SCALE, None)], ErrorLog("m"))
    sections, scalars = read(packet)
    assert sections == {"grad": ((1, 0), (10, 20), [[3.0, 0, 0], [4.0, 1, 0]]),
                        "grad_flow": ((2, 0), (5, 7), [[1.5, 0, 0], [2.5, 0, 3]])}
    assert scalars == {S.SCALAR_LOSS: 0.25}


def test_the_loss_scale_is_divided_out_of_norms_and_never_out_of_counts():
    packet = write(blank(), (S.GRAD_FLOW,), {"grad_flow": flow((0, 5, 8.0, 2, 1))}, {}, torch.tensor(4.0), [],
                   ErrorLog("m"))
    assert read(packet)[0]["grad_flow"][2] == [[2.0, 2, 1]]


def test_records_made_many_at_once_follow_those_made_one_by_one():
    records = flow((3, 5, 1.0, 0, 0))
    records.add_rows((1, 2), (6, 7), (torch.tensor([[5.0], [6.0]]), torch.tensor([[0, 0], [1, 0]])))
    records.commit()
    keys, numels, rows = read(write(blank(), (S.GRAD_FLOW,), {"grad_flow": records}, {}, None, [], ErrorLog("m")))[0][
        "grad_flow"]
    assert (keys, numels, rows) == ((3, 1, 2), (5, 6, 7), [[1.0, 0, 0], [5.0, 0, 0], [6.0, 1, 0]])


def test_a_statistic_that_cannot_be_written_misses_the_step_alone_and_is_counted():
    class Broken:
        rows = []

        def committed(self):
            raise RuntimeError("injected")

    errors = ErrorLog("m")
    packet = write(blank(), (S.ACTIVATION, S.GRAD_FLOW), {"activation": Broken(), "grad_flow": flow((0, 5, 1.0, 0, 0))},
                   {}, None, [], errors)
    assert list(read(packet)[0]) == ["grad_flow"] and errors.counts()["step"] == 1


def test_a_step_without_values_leaves_the_packet_as_it_was():
    packet = blank()
    assert write(packet, (S.GRAD, S.GRAD_FLOW), {"grad_flow": _Records(keyed=False)}, {}, None,
                 [(S.SCALAR_LOSS, None)], ErrorLog("m"), sampled=False, detail=True) is packet


# -- the layout writer and readers share --------------------------------------------------------

def test_the_layout_places_each_part_of_each_section_then_the_scalars():
    grad, flow_ = S.Section(S.GRAD, (4, 1), (9, 9)), S.Section(S.GRAD_FLOW, (0,), (3,))
    placed = S.layout([grad, flow_], [S.SCALAR_LOSS, S.SCALAR_AMP_SCALE])
    blocks = [tuple(b) for _, bs in placed.sections for b in bs]
    assert blocks == [(0, 2, 3), (6, 1, 1), (7, 1, 2)]  # grad's one part; grad_flow's norm, then counts
    assert placed.scalars == {S.SCALAR_LOSS: 9, S.SCALAR_AMP_SCALE: 10} and placed.size == 11


def test_a_column_of_a_part_lies_every_width_values_from_its_first():
    (_, (block,)), = S.layout([S.Section(S.GRAD, (4, 1, 2), (1, 1, 1))], offset=5).sections
    assert list(block.column(1)) == [6, 9, 12] and block.stop == 14


def test_the_packet_is_exactly_as_long_as_its_layout():
    grad = (torch.tensor([[3.0, 0, 0], [4.0, 1, 0]]), (1, 0), (10, 20))
    packet = write(blank(), (S.GRAD, S.GRAD_FLOW), {"grad_flow": flow((2, 5, 1.5, 0, 0))},
                   {"grad": grad}, None, [(S.SCALAR_LOSS, torch.tensor(0.25))], ErrorLog("m"))
    assert len(packet.data) == S.layout(packet.sections, packet.scalars).size


def test_a_block_that_does_not_fit_its_place_in_the_layout_is_never_packed():
    wrong = (torch.zeros(2, 4), (1, 0), (10, 20))  # four columns where GRAD declares three
    with pytest.raises(ValueError, match="grad's block holds 8 values where the packet's layout has 2 x 3"):
        write(blank(), (S.GRAD,), {}, {"grad": wrong}, None, [], ErrorLog("m"))
