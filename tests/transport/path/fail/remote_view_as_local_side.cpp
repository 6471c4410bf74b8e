// Must NOT compile: sending a remote_view (space Remote<Host>), a peer's
// memory, as if it were a local buffer.
#include <gdr/transport/loopback.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/tcp.hpp>

void send_a_remote_view() { gdr::require_path<gdr::tcp::transport, gdr::op::send, gdr::Remote<gdr::Host>>(); }
