"""dtrain-relay: a raw TCP relay, so phones on the LAN reach a node that listens on localhost.

Every accepted connection opens one to the target and bytes are piped both ways unchanged, so HTTP,
WebSocket upgrades and frames all pass. Reads are bounded by `buffer_bytes` and every write is
drained before the next read, so a slow side back-pressures the fast one instead of filling memory.
When either side closes (or errors), both connections are closed.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Optional
from hivemind.utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_BUFFER_BYTES = 64 * 1024


@dataclass(frozen=True)
class RelayConfig:
    listen_host: str = "0.0.0.0"  # where the relay accepts connections
    listen_port: int = 9095  # relay port (0 picks a free one)
    target_host: str = "127.0.0.1"  # the node's bridge host
    target_port: int = 8095  # the node's bridge port
    buffer_bytes: int = DEFAULT_BUFFER_BYTES  # largest single read, per direction
    connect_timeout_s: float = 10.0  # bound on opening the target connection
    half_close_timeout_s: float = 30.0  # after the client's EOF, how long the target may still answer


async def _pipe(label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, buffer_bytes: int) -> int:
    """Copy reader -> writer until EOF; returns bytes copied. Half-closes the writer at EOF."""
    copied = 0
    while True:
        data = await reader.read(buffer_bytes)
        if not data:
            break
        writer.write(data)
        await writer.drain()
        copied += len(data)
    if writer.can_write_eof():
        try:
            writer.write_eof()
        except OSError:
            pass
    logger.debug("%s: EOF after %d bytes", label, copied)
    return copied


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), timeout=5.0)
    except (OSError, asyncio.TimeoutError):
        pass


async def _handle(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, config: RelayConfig
) -> None:
    peer = client_writer.get_extra_info("peername")
    try:
        target_reader, target_writer = await asyncio.wait_for(
            asyncio.open_connection(config.target_host, config.target_port), timeout=config.connect_timeout_s
        )
    except (OSError, asyncio.TimeoutError) as e:
        logger.warning("relay %s: cannot reach %s:%d (%s)", peer, config.target_host, config.target_port, e)
        await _close(client_writer)
        return
    logger.info("relay %s <-> %s:%d opened", peer, config.target_host, config.target_port)
    up = asyncio.create_task(_pipe(f"{peer} ->", client_reader, target_writer, config.buffer_bytes))
    down = asyncio.create_task(_pipe(f"{peer} <-", target_reader, client_writer, config.buffer_bytes))
    sent = received = 0
    try:
        done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        if up in done and down not in done and up.exception() is None:
            # The client half-closed (its EOF was passed on): let the target finish its answer, bounded.
            await asyncio.wait({down}, timeout=config.half_close_timeout_s)
        for task in (up, down):
            if task.done() and not task.cancelled() and task.exception() is not None:
                logger.info("relay %s: %s", peer, task.exception())
            task.cancel()
        results = await asyncio.gather(up, down, return_exceptions=True)
        sent, received = (r if isinstance(r, int) else 0 for r in results)  # cut short: not counted
    finally:
        up.cancel()
        down.cancel()
        await _close(target_writer)
        await _close(client_writer)
    logger.info("relay %s closed (%d bytes up, %d bytes down)", peer, sent, received)


async def start(config: RelayConfig) -> asyncio.Server:
    """Listen and relay in the background; the caller owns the returned server (close() it)."""
    if not 1 <= config.buffer_bytes <= 16 * 1024 * 1024:
        raise ValueError(f"buffer_bytes must be in [1, 16 MiB], got {config.buffer_bytes}")
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, config), config.listen_host, config.listen_port
    )
    for sock in server.sockets:
        logger.info("relay listening on %s -> %s:%d", sock.getsockname(), config.target_host, config.target_port)
    return server


async def serve(
    listen_host: str = "0.0.0.0",
    listen_port: int = 9095,
    target_host: str = "127.0.0.1",
    target_port: int = 8095,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
) -> None:
    """Relay until cancelled."""
    server = await start(RelayConfig(listen_host, listen_port, target_host, target_port, buffer_bytes))
    async with server:
        await server.serve_forever()


def run(config: RelayConfig) -> None:
    """Relay in the foreground until interrupted."""
    try:
        asyncio.run(serve(config.listen_host, config.listen_port, config.target_host, config.target_port, config.buffer_bytes))
    except KeyboardInterrupt:
        pass


def _host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{flag} expects HOST:PORT (e.g. 0.0.0.0:9095), got {text!r}")
    return host.strip("[]"), int(port)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dtrain-relay", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="0.0.0.0:9095", type=lambda s: _host_port(s, "--listen"),
                        help="HOST:PORT to accept connections on (default 0.0.0.0:9095)")
    parser.add_argument("--target", default="127.0.0.1:8095", type=lambda s: _host_port(s, "--target"),
                        help="HOST:PORT of the node's bridge (default 127.0.0.1:8095)")
    parser.add_argument("--buffer-bytes", type=int, default=DEFAULT_BUFFER_BYTES, help="largest single read (default 64 KiB)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    (listen_host, listen_port), (target_host, target_port) = args.listen, args.target
    run(RelayConfig(listen_host, listen_port, target_host, target_port, args.buffer_bytes))


if __name__ == "__main__":
    main()
