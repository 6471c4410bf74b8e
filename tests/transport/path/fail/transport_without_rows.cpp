// Must NOT compile: a transport that declares no rows gets the conservative
// default, unsupported, for everything, with the default's message.
#include <gdr/transport/loopback.hpp>
#include <gdr/transfer/path.hpp>
#include <gdr/transport/tcp.hpp>

struct rowless_transport;

void send_over_rowless() { gdr::require_path<rowless_transport, gdr::op::send, gdr::Host>(); }
