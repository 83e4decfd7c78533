"""Recording the widths the grouped expert kernel computed."""

from mlx_mtp.exactness import grouped_experts, row_exact_layers


def record_kernel_rows(monkeypatch) -> list:
    """The widths of the verify blocks (and one-token steps) the expert kernel computes from now
    on, appended to the returned list as they run."""
    seen = []
    real = grouped_experts.kernel_call

    def recording(glu, x, indices, *stacks):
        if row_exact_layers.active():  # a verify or a one-token step, not the install's check
            seen.append(grouped_experts.rows_of(indices))
        return real(glu, x, indices, *stacks)

    monkeypatch.setattr(grouped_experts, "kernel_call", recording)
    return seen
