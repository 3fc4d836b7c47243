"""Every test runs on 8 simulated CPU devices (set before JAX starts its backend)."""

import jax

import mirrored

jax.config.update("jax_platforms", "cpu")
mirrored.simulate_cpu_devices(8)

import pytest  # noqa: E402


@pytest.fixture
def devices() -> list[jax.Device]:
    found = jax.devices()
    assert len(found) == 8, "conftest must simulate 8 CPU devices before JAX starts"
    return found
