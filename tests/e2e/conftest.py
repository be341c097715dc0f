"""The e2e lane's fixtures (tests/harness): the local host (``local_env``,
``private_tmux_socket``, ``webhook``), launches through the command line
(``launch_tmux_socket``, ``private_tmux_socket_and_home``) and one run on two sshd
hosts (``pair``). A module whose tmux servers must live on a private socket asks
for one with ``pytestmark = pytest.mark.usefixtures(...)``."""

from tests.harness.launch import launch_tmux_socket, private_tmux_socket_and_home  # noqa: F401
from tests.harness.local import local_env, private_tmux_socket, webhook  # noqa: F401
from tests.harness.multihost import pair  # noqa: F401
