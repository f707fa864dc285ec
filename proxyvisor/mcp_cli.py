"""Command line of ``proxyvisor mcp`` (registered by cli.py): the MCP server on stdio. The server and the MCP SDK
(:mod:`proxyvisor.mcp_server`) are imported only when the command runs: importing the SDK took 2.0-2.5 s on a busy
2-core machine, which neither ``proxyvisor --help`` nor the proxy should pay."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import Any

from .cli import _FILES, _config
from .config import Config, validate
from .info_cli import _url_arg

_HELP = textwrap.dedent("""\
    Serve proxyvisor's tools to an MCP client (Claude Code, Codex, any client of the Model Context
    Protocol) over stdio: the client starts this command and speaks JSON-RPC on its stdin and stdout;
    logs go to stderr. It needs no running proxy for most tools, and no API key.

    tools:
      session_info    the /info object of a session: model requests, tool rounds, self-reports,
                      detector fires and steer notes, verify-gate outcomes, condensed results, tokens,
                      cost and overhead ('proxyvisor info --json')
      session_plan    the /plan object of a session: its plan with each phase's status, the user's
                      prohibitions in force and the retained critical knowledge ('proxyvisor plan --json')
      routing_config  show the delegation and routing policy ([model_routing]) with each role's resolved
                      route and each adapter's readiness; or enable, disable, or set fields of it, validated
                      against the adapter descriptors before anything is written, exactly as 'proxyvisor
                      routing enable|disable|set' ('routing show --json' is what show returns)
      pool_health     every model pool's breaker state: healthy, cooling_down, half_open
                      ('proxyvisor health show --json')
      delegate        run one child for a role and return its shaped result, status and evidence
                      ('proxyvisor delegate --json'; delegation must be enabled)

    A refusal, a bad argument or a failed child is a tool error (isError) whose text says why.

    where the answers come from:
      session_info and session_plan ask the proxy at --url, else the one named by $PROXYVISOR_URL (set
      by 'proxyvisor wrap' and 'batch' for the agent, so an MCP server the wrapped agent starts asks
      the proxy of its own run), else http://[proxy] host:port of the configuration, as 'proxyvisor
      info' does (with [proxy] auth_token and admin_token sent when set). When no proxy answers,
      session_info sums the session's ledger in the state directory (its "live" is then null), and
      session_plan reads the session's stored supervision state there (an error when none is stored).
      routing_config reads and writes the configuration file (--config, else $PROXYVISOR_CONFIG, else
      ~/.config/proxyvisor/config.toml; a write creates it), read again on every call, so a change made
      meanwhile by hand or by 'proxyvisor routing' is seen. pool_health reads the state directory, where
      every proxy keeps its breakers. delegate runs the child in this process, as 'proxyvisor delegate'
      does: on the adapters of the policy, under the breakers of the state directory; a cancelled call
      stops its child (SIGTERM to its process group, SIGKILL after stop_grace_s).

    the current session (when a call names none):
      $PROXYVISOR_SESSION, which 'proxyvisor wrap' and 'batch' set for the agent they run: an MCP
      server started by that agent inherits it, so "current" is the agent's own session (Codex passes
      an MCP server few of its variables: add env_vars = ["PROXYVISOR_URL", "PROXYVISOR_SESSION"] to
      its [mcp_servers.NAME] table). Without it, the most recently active session: the proxy's list with
      [proxy] admin_token, else the ledger written last.

    exit status:
      0 the client closed the connection; 2 bad usage or configuration (nothing served). A tool's
      failure never ends the server.
    """)
_EXAMPLES = textwrap.dedent("""\
    examples:
      claude mcp add proxyvisor -- proxyvisor mcp
      claude mcp add proxyvisor -- /path/to/venv/bin/python -m proxyvisor mcp --config ~/pv.toml
      codex mcp add proxyvisor -- proxyvisor mcp            then add env_vars (see above) to its table
      proxyvisor wrap -- claude -p "call session_info"     the tools answer for this run's session
    """)


def register(commands: Any, common: Callable[[argparse.ArgumentParser], None], formatter: type) -> None:
    """Add ``mcp`` to the ``proxyvisor`` subparsers; it sets ``handler(args, config)``."""
    parser = commands.add_parser("mcp", help="serve session info, plans, routing, health and delegation as MCP tools "
                                             "over stdio", formatter_class=formatter, description=_HELP,
                                 epilog=_EXAMPLES + "\n" + _FILES)
    parser.add_argument("--url", metavar="URL", type=_url_arg,
                        help="the proxy session_info and session_plan ask, http(s)://HOST[:PORT] (default: the one "
                             "in $PROXYVISOR_URL, else http://[proxy] host:port)")
    common(parser)
    # routing_config writes the file --config names, creating it: until then the configuration is the defaults.
    parser.set_defaults(handler=_mcp, creates_config=True)


def _mcp(args: argparse.Namespace, config: Config) -> int:
    from .mcp_server import serve
    from .routing_cli import _config_path

    def current() -> Config:
        fresh = _config(args)
        validate(fresh)
        return fresh

    return serve(current, _config_path(args), args.url)
