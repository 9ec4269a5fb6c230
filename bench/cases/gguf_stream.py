"""The gguf-stream case: a streamed GGUF build (4 of 16 layers' routed experts from Q8_0) against fetching both
quantizations and building from the cache, through a local hub look-alike that counts the bytes it serves;
then the same arithmetic on a DeepSeek-class model's tensor table (:func:`deepseek_projection`)."""

from __future__ import annotations

from harness import DATA, drop, gguf_dataset, race_fetch_and_stream, row


def case_gguf_stream(runs: int, size_gb: float) -> None:
    """A streamed GGUF build (4 of 16 layers' routed experts from Q8_0) against fetching both quantizations
    and building from the cache, through a local hub look-alike that counts the bytes it serves; then the
    same arithmetic on a DeepSeek-class model's tensor table (:func:`deepseek_projection`)."""
    from mosaic.testing.hub import FakeHub

    base = gguf_dataset(f"gguf-{size_gb}g-Q4_0", "Q4_0", size_gb)
    donor = gguf_dataset(f"gguf-{size_gb}g-Q8_0", "Q8_0", size_gb)
    home = DATA / "gguf-stream-hf"
    out = DATA / "gguf-stream-out"
    case = f"gguf stream: {base.stat().st_size / 1e9:.2f} GB Q4_0 + {donor.stat().st_size / 1e9:.2f} GB Q8_0 via a local hub"
    with FakeHub() as hub:
        hub.redirect_lfs = True
        sha = hub.commit("bench/gguf", {"Q4_0/m-Q4_0.gguf": base.read_bytes(), "Q8_0/m-Q8_0.gguf": donor.read_bytes()})
        recipe = DATA / f"gguf-stream-{size_gb}g.yaml"
        recipe.write_text(
            f"name: gguf-stream\nbase:\n  repo: bench/gguf\n  revision: {sha}\n  file: Q4_0\n"
            f"donors:\n  q8:\n    repo: bench/gguf\n    revision: {sha}\n    file: Q8_0\n"
            "replace:\n  - from: q8\n    layers: [2, 5, 9, 13]\n    modules: [ffn_exps]\n"
        )
        moved = race_fetch_and_stream(case, hub, recipe, home, out, runs, "fetch then build")
        output = sum(p.stat().st_size for p in out.glob("*.gguf"))
        for name, n in moved.items():
            row(case, f"{name}: bytes from the hub", f"{n / 1e9:.3f} GB", f"{n / moved['fetch then build']:.2f} × fetch; "
                f"{n / output:.3f} × the output")
        drop(home)
        drop(out)
    for name, value, note in deepseek_projection():
        row("gguf stream: DeepSeek-class projection", name, value, note)


def deepseek_projection(layers_taken: int = 10) -> list[tuple[str, str, str]]:
    """A DeepSeek-V3-class tensor table from its published geometry (61 layers, the first 3 dense, 58 MoE
    with 256 routed experts and one shared; hidden 7168, expert width 2048, dense width 18432, MLA with
    q_lora 1536, kv_lora 512, 128 heads of 128 + 64 rope; vocabulary 129,280) and the bytes a GGUF mosaic
    taking ``layers_taken`` layers' routed experts from a Q4_K_M into a Q2_K reads by ranges, against
    downloading both. Assumed per type (bits per weight, llama.cpp's block sizes): Q2_K 2.625, Q4_K 4.5,
    Q6_K 6.5625; Q2_K's routed experts Q2_K, its other tensors Q4_K, output Q6_K; Q4_K_M's routed experts
    half Q4_K, half (ffn_down) Q6_K, its other tensors Q4_K, output Q6_K; headers 10 MB a file."""
    h, ff_e, ff_d, n_exp, vocab = 7168, 2048, 18432, 256, 129_280
    mla = h * 1536 + 1536 * 128 * 192 + h * (512 + 64) + 512 * 128 * 256 + 128 * 128 * h
    experts = 3 * n_exp * h * ff_e  # per MoE layer
    shared = 3 * h * ff_e
    other = 3 * 3 * h * ff_d + 61 * mla + 58 * shared + vocab * h  # dense MLPs, attention, shared experts, embeddings
    output = vocab * h
    q2, q4, q6 = 2.625 / 8, 4.5 / 8, 6.5625 / 8
    q2k = 58 * experts * q2 + other * q4 + output * q6
    q4km_experts = experts * (2 / 3 * q4 + 1 / 3 * q6)
    q4km = 58 * q4km_experts + other * q4 + output * q6
    header = 10e6
    streamed = q2k - layers_taken * experts * q2 + layers_taken * q4km_experts + 2 * header
    params = 58 * experts + other + output
    return [
        ("parameters", f"{params / 1e9:.0f} B", "671 B published"),
        ("Q2_K file", f"{q2k / 1e9:.0f} GB", ""),
        ("Q4_K_M file", f"{q4km / 1e9:.0f} GB", ""),
        (f"mosaic: {layers_taken} layers' routed experts from Q4_K_M", f"{streamed / 1e9:.0f} GB read by --stream",
         f"{streamed / (q2k + q4km):.2f} × fetching both ({(q2k + q4km) / 1e9:.0f} GB)"),
    ]
