"""Header bar: engine config, connection state, step, rates, drops and staleness."""

from __future__ import annotations

from rich.text import Text

from kvscope.protocol.engine_info import engine_name, usable_blocks
from kvscope.tui import fmt
from kvscope.tui.model.state import CONN_CONNECTING, CONN_LIVE, CONN_REPLAY
from kvscope.tui.widgets.base import StateWidget, join_lines


class HeaderBar(StateWidget):
    """Two lines: what is running (model, device, mode, policy, blocks), then how it is doing.

    ``address`` and ``paused`` come from the screen's feed (the engine's own pause reply)."""

    address = ""
    paused = False
    loading: str | None = None  # an engine this view started, until its first step (`kvscope demo`)

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(20, self.size.width)
        top = Text(no_wrap=True, overflow="ellipsis")
        top.append(" kvscope ", style="bold reverse")
        if st is None:
            return top
        cfg = st.config
        if cfg is not None:
            top.append(f" {cfg.model or '?'}", style="bold")
            top.append(f" · {cfg.device or '?'}")
            if cfg.quantization == "gguf":  # linear layers on the GGUF's own blocks (--quantization gguf)
                top.append(" · GGUF blocks", style=pal.dim)
            engine = engine_name(cfg)
            version = cfg.vllm_version if isinstance(cfg.vllm_version, str) else ""
            if engine == "vllm":  # a real vLLM served (watched from inside, or its stat logger)
                top.append(f" · vLLM {version}".rstrip(), style=f"bold {pal.warn}")
            elif cfg.scheduler == "vllm":  # kvscope's engine loop, vLLM's scheduler class deciding
                top.append(" · kvscope engine")
            backend = cfg.backend
            if backend == "sim":
                top.append(" · ")
                top.append(" SIM ", style=f"bold black on {pal.warn}")
                top.append(" virtual clock", style=pal.dim)
            elif backend:
                top.append(f" · {backend}", style=pal.dim)
            if cfg.scheduler == "vllm":  # vLLM's own V1 scheduler decides every step (--scheduler vllm)
                top.append(f" │ vLLM {version} scheduler".replace("  ", " "), style=f"bold {pal.warn}")
            else:
                top.append(f" │ {cfg.mode or '?'}", style="bold")
            top.append(f" · {cfg.policy or '?'}")
            nb = usable_blocks(cfg) or st.kv.total or len(st.blocks)  # vLLM: its null block is no KV block
            top.append(f" │ {nb}×{cfg.block_size} blocks")
            budget = cfg.max_num_batched_tokens
            if budget:
                top.append(f" · budget {budget}", style=pal.dim)
            seqs = cfg.max_num_seqs
            if seqs:
                top.append(f" · seqs {seqs}", style=pal.dim)
        elif self.loading:
            top.append(f" ⧗ {self.loading}", style=f"bold {pal.warn}")
        else:
            top.append(" engine config unknown (hello not seen yet)", style=pal.dim)

        bot = Text(no_wrap=True, overflow="ellipsis")
        conn = st.conn
        if conn == CONN_LIVE:
            bot.append(" ● live ", style=f"bold {pal.ok}")
            if not (st.running or st.waiting or st.preempted):  # up, with nothing to do (heartbeats)
                bot.append("· idle ", style=pal.dim)
        elif conn == CONN_REPLAY:
            bot.append(" ▶ replay ", style=f"bold {pal.bar}")
        elif conn == CONN_CONNECTING:
            bot.append(" ○ disconnected ", style=f"bold {pal.bad}")
            bot.append(f"waiting for engine {self.address} ", style=pal.dim)
        else:
            bot.append(" ○ disconnected ", style=f"bold {pal.bad}")
            bot.append("last picture kept ", style=pal.dim)
        if self.paused:
            bot.append("⏸ paused ", style=f"bold {pal.warn}")
        if st.ended and conn != CONN_LIVE:
            bot.append(f"(engine said bye: {st.ended}) ", style=pal.dim)
        its, toks = st.rates()
        bot.append(f"│ step {max(st.step, 0)} ")
        bot.append(f"│ {fmt.rate(its)} it/s ")
        bot.append(f"│ {fmt.rate(toks)} tok/s ")
        gp = st.goodput
        if gp is not None and gp.slo:
            fig = gp.figures()
            # run averages over the finished requests (first arrival to last finish), so goodput is read
            # against the throughput of the same requests, not the windowed rate beside it
            bot.append("│ goodput ")
            style = f"bold {pal.ok if fig.attainment in (None, 1.0) else pal.warn}"
            bot.append(f"{fmt.rate(fig.goodput_tok_per_s)}", style=style)
            bot.append(f"/{fmt.rate(fig.output_tok_per_s)} tok/s ")
            for key, share in fig.met.items():
                bot.append(f"{key} {'-' if share is None else f'{share * 100:.0f}%'} ", style=pal.dim)
        bot.append(f"│ done {st.finished_count} ", style=pal.dim)
        if st.rejected_count:
            bot.append(f"rej {st.rejected_count} ", style=pal.warn)
        dropped = st.dropped + st.local_dropped
        bot.append("│ drop ", style=pal.dim)
        bot.append(f"{dropped} ", style=f"bold {pal.bad}" if dropped else pal.dim)
        if st.malformed:
            bot.append(f"bad {st.malformed} ", style=f"bold {pal.bad}")
        if st.notice:
            bot.append(f"⚠ {st.notice} ", style=f"bold {pal.warn}")
        if st.stale:
            bot.append(" STALE until next snapshot ", style=f"bold black on {pal.warn}")
            if st.stale_reason:
                bot.append(f" {st.stale_reason}", style=pal.warn)
        top.truncate(width, overflow="ellipsis")
        bot.truncate(width, overflow="ellipsis")
        return join_lines([top, bot])
