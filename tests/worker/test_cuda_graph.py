"""Batch-size buckets of the CUDA graphs (CPU: no graph is captured here)."""

from vllm_spec.worker.cuda_graph import BATCH_BUCKETS, bucket_for


def test_a_batch_goes_to_the_smallest_bucket_that_holds_it():
    for batch in range(0, BATCH_BUCKETS[-1] + 50):
        fits = [b for b in BATCH_BUCKETS if b >= batch]
        assert bucket_for(batch) == (min(fits) if fits else None), batch
