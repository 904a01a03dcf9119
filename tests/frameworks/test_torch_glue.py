"""What frameworks see of dataset_rt.torch.DataLoader, checked in one process: its sampler
describes the rank split, and its state follows torchdata's StatefulDataLoader protocol."""

from __future__ import annotations

import pytest
from framework_helpers import require

torch = require("torch")
import jobs_common as common  # noqa: E402 (after the skip: it imports torch)
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import dataset_rt.torch  # noqa: E402
from dataset_rt import ConfigError, DatasetRuntime, ReaderConfig  # noqa: E402


@pytest.fixture
def dataset(tmp_path):
    common.write_cache(tmp_path)
    with DatasetRuntime(num_workers=1) as runtime:
        config = ReaderConfig(seed=common.SEED, rank=1, world_size=2)
        result = runtime.open_caches(common.CACHE, tmp_path, reader_config=config)
        assert result.dataset is not None
        yield result.dataset


def ids(loader) -> list[list[int]]:
    return [batch[2].tolist() for batch in loader]


def new_loader(dataset):
    return dataset_rt.torch.DataLoader(
        dataset, batch_size=common.BATCH_SIZE, transform=common.to_example
    )


@pytest.mark.torch
def test_the_sampler_is_the_rank_split_and_cannot_be_iterated(dataset):
    with new_loader(dataset) as loader:
        sampler = loader.sampler
        assert isinstance(sampler, DistributedSampler)
        assert (sampler.rank, sampler.num_replicas) == (1, 2)
        assert (sampler.seed, sampler.shuffle) == (common.SEED, True)
        assert len(sampler) == len(dataset) == 20  # 39 samples, one of padding
        assert loader.batch_sampler.sampler is sampler
        with pytest.raises(ConfigError, match="iterate the loader itself"):
            iter(sampler)


@pytest.mark.torch
def test_sampler_set_epoch_keeps_a_loaded_mid_epoch_state(dataset):
    with new_loader(dataset) as loader:
        epoch0, epoch1 = ids(loader), ids(loader)
        assert epoch0 != epoch1
    with new_loader(dataset) as loader:
        batches = iter(loader)
        next(batches)
        next(batches)
        state = loader.state_dict()
    with new_loader(dataset) as loader:
        loader.load_state_dict(state)
        loader.sampler.set_epoch(0)  # what Lightning does at each epoch's start
        assert ids(loader) == epoch0[2:]
        loader.sampler.set_epoch(1)  # the state is in epoch 1 now: nothing changes
        assert ids(loader) == epoch1
        loader.sampler.set_epoch(0)  # another epoch: read it from its start
        assert ids(loader) == epoch0


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("resumed", [False, True])
def test_sampler_set_epoch_after_iter_keeps_the_pass_that_moves_the_state(
    dataset, num_workers, resumed
):
    """Lightning's fit() calls iter(loader), then sampler.set_epoch(epoch), then reads: the pass
    must stay the one the state follows, or every checkpoint of that epoch holds its start and
    a resume reads the start again and never the rest."""
    with new_loader(dataset) as loader:
        epoch0, epoch1 = ids(loader), ids(loader)
    with dataset_rt.torch.DataLoader(
        dataset, batch_size=common.BATCH_SIZE, transform=common.to_example, num_workers=num_workers
    ) as loader:
        if resumed:  # a state taken after 2 batches of epoch 0, loaded
            with new_loader(dataset) as first:
                batches = iter(first)
                next(batches)
                next(batches)
                loader.load_state_dict(first.state_dict())
        skip = 2 if resumed else 0  # batches of epoch 0 the loaded state had received
        for epoch, expected in ((0, epoch0[skip:]), (1, epoch1)):
            batches = iter(loader)
            loader.sampler.set_epoch(epoch)
            got = [next(batches)[2].tolist(), next(batches)[2].tolist()]
            state = loader.state_dict()
            # The checkpoint resumes after those two batches (it held the pass's start).
            with new_loader(dataset) as resumed_loader:
                resumed_loader.load_state_dict(state)
                assert ids(resumed_loader) == expected[2:]
            got += [batch[2].tolist() for batch in batches]
            assert got == expected


@pytest.mark.torch
def test_sampler_set_epoch_reads_again_an_epoch_whose_pass_was_left_early(dataset):
    # Lightning's sanity check takes a few validation batches, then the epoch's validation
    # calls sampler.set_epoch(0) and reads the loader: the whole of epoch 0, not epoch 1.
    with new_loader(dataset) as loader:
        epoch0 = ids(loader)
    with new_loader(dataset) as loader:
        loader.sampler.set_epoch(0)
        for _ in zip(range(2), loader, strict=False):
            pass
        assert loader.state_dict()["epoch"] == 0  # the state is inside epoch 0
        loader.sampler.set_epoch(0)
        assert ids(loader) == epoch0


# Not marked `torch`: it skips without torchdata (required under DATASET_RT_REQUIRE_FRAMEWORKS=1).
def test_follows_the_stateful_dataloader_protocol(dataset):
    stateful = require("torchdata.stateful_dataloader")
    with new_loader(dataset) as loader:
        assert isinstance(loader, stateful.Stateful)
        epoch0, epoch1 = ids(loader), ids(loader)
    # As StatefulDataLoader: a state taken mid-epoch resumes at the next batch ...
    with new_loader(dataset) as loader:
        batches = iter(loader)
        next(batches)
        middle = loader.state_dict()
        rest = [batch[2].tolist() for batch in batches]
        # ... and one taken after the epoch's last batch starts the next epoch.
        end = loader.state_dict()
    assert rest == epoch0[1:]
    for state, expected in ((middle, epoch0[1:]), (end, epoch1)):
        with new_loader(dataset) as loader:
            loader.load_state_dict(state)
            assert ids(loader) == expected


# Not marked `torch`: it skips without Lightning (required under DATASET_RT_REQUIRE_FRAMEWORKS=1).
@pytest.mark.parametrize("workers", [0, 2])
def test_takes_lightnings_prediction_wrapper_and_fills_its_indices(dataset, workers):
    """What Trainer.predict does to a loader, without a Trainer: re-create it around an
    index-recording wrapper of its batch sampler."""
    distributed = require("lightning.pytorch.overrides.distributed")
    extra = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    with new_loader(dataset) as original:
        expected = ids(original)  # epoch 0; the original now stands at epoch 1
        following = ids(original)
        original.set_epoch(0)
        inner = torch.utils.data.BatchSampler(original.sampler, common.BATCH_SIZE, False)
        wrapper = distributed._IndexBatchSamplerWrapper(inner)
        with dataset_rt.torch.DataLoader(
            dataset, batch_sampler=wrapper, batch_size=1, transform=common.to_example, **extra
        ) as predicting:
            assert predicting.batch_sampler is wrapper
            assert len(predicting) == len(original) == 5
            seen = []
            for batch in predicting:
                seen.append(batch[2].tolist())
                # Filled as each batch is delivered, as Lightning reads it.
                assert wrapper.seen_batch_indices[-1] == seen[-1]
            assert seen == expected
            assert wrapper.seen_batch_indices == expected  # sample_id is the row number
            assert ids(predicting) == following
            assert wrapper.seen_batch_indices == following  # each pass starts a new record
        other = distributed._IndexBatchSamplerWrapper(
            torch.utils.data.BatchSampler(range(20), common.BATCH_SIZE, False)
        )
        with pytest.raises(ConfigError, match="prediction batch sampler only around"):
            dataset_rt.torch.DataLoader(dataset, batch_sampler=other, batch_size=1)
