/// \file
/// The protocol layer: one engine per endpoint, the same for every
/// transport. It owns the endpoint's operations and everything that makes
/// them correct: matching receives to messages by tag, the bounded store of
/// early messages, eager and rendezvous sends, truncation, one-sided
/// requests and their answers, cancellation and timeouts, failure, and the
/// per-operation records and counters. A transport derives from `engine`
/// and only moves bytes (see "The transport's side" below).
///
/// How it works
/// ============
/// An engine lives on the heap and belongs to one scheduler; everything
/// here runs on that scheduler's thread (stop requests from other threads
/// are posted to it). The endpoint object owns it; once the endpoint is
/// gone the engine frees itself when the transport is quiet and every
/// operation has resumed (`abandon`).
///
/// Messages. A send of at most `rendezvous_threshold` bytes goes *eager*:
/// the whole message in one `eager` frame. The receiver places it straight
/// into the first posted receive of its tag, or keeps a copy if none is
/// posted (`unexpected_bytes`, `unexpected_messages`: the room granted to
/// the sender in advance, see "Early credits" below; a sender short of
/// bytes announces instead, short of messages it waits). A
/// larger send goes by *rendezvous*: an `rts` announces it; the receive
/// that matches it answers `rtr` with a token and the bytes it accepts;
/// the sender then writes the bytes in a `data` frame that the receiver
/// places straight into that receive. An unmatched announcement costs the
/// receiver a small record, never the message's bytes, and never blocks
/// the messages behind it. Every send announces at once, so many
/// rendezvous are in flight together.
///
/// Matching. Receives match messages of the same tag in the order both
/// were started (eager and announced messages alike). A message larger than
/// its receive fills the view, the rest is dropped (eager) or never sent
/// (rendezvous: the `rtr` accepts only the view's size), and the receive
/// fails with `errc::truncated`, reporting the message's size.
///
/// Handshake. Each side's first frame is `hello` (protocol version, the
/// largest message it accepts, capabilities). Sends, puts and gets wait
/// for the peer's hello before they go out; one larger than the peer
/// accepts fails alone (`errc::message_too_large`).
///
/// Completion and resumption. Whatever decides an operation's outcome (a
/// frame, a timer, a stop request, a failure) only records it; the
/// operation resumes from the ready list at the end of the current event
/// handler (`leave`), when the engine's state is consistent, and only once
/// the transport no longer uses the operation's memory: none of its frames
/// is being written and no payload is being placed into its view.
///
/// Cancellation and timeouts: withdrawn until committed, then it completes.
/// What is not committed ends at its stop or deadline whatever the peer
/// does (a peer that does not run its loop answers nothing).
///   * A receive stops at once. If its message was being placed, the rest
///     is dropped; if it had answered an `rts`, the data that comes is
///     dropped (the sender completes normally).
///   * An eager send is withdrawn while its frame waits in the transport;
///     once the transport has committed it (begun writing it), it
///     completes normally.
///   * A send waiting for early credit has not left: it ends at once.
///   * A rendezvous send is withdrawn, at once, until the `rtr` has reached
///     this side: no byte has moved before it. Its `rts` is the engine's
///     (an `announcement`, engine/withdrawals.hpp), so the send resumes
///     even while the transport holds that frame; an `rts` not yet out is
///     taken back, else an `rts_cancel` follows it. The peer answers that
///     with `rts_withdrawn`, or, if a receive had matched it first, its
///     `rtr` comes late and this side answers it with a `data` frame
///     flagged `withdrawn`: that receive takes the next message of its tag
///     (or fails with `errc::withdrawn` where that would break the order
///     of its tag). The message credit comes back with the peer's answer.
///     Once the `rtr` has come, the send is committed.
///   * A put or get stops at once unless its request is being written; a
///     late answer is dropped.
///
/// Close. `close()` sends a `close` frame after every send already started
/// (held ones once the hello arrives; rendezvous ones once their receive has
/// taken them: a close waits for the peer to receive what was sent, bounded
/// by the close's own timeout; a closing peer declines the announcements it
/// will never receive with `rts_withdrawn`, and those sends fail with
/// `errc::peer_closed`), then fails what is still pending with
/// `errc::closed`; the peer fails its pending operations with
/// `errc::peer_closed` after receiving everything sent before. Both ends
/// then end the connection in order (`link_close`): a stream transport
/// ends its half and reads what the peer still sends until the peer's end,
/// so that nothing sent before is lost to a reset; close() returns when
/// the transport has ended (or its timeout aborts it: `link_shutdown`).
/// The close frame is the last frame this side sends: a frame posted after
/// it (the next request of a put or get moved as segments, an answer to a
/// request, a decline) is returned unsent from the outbox, as if the
/// connection had ended there, and its operation fails with `errc::closed`
/// (a peer would drop it after the close frame anyway; a TCP peer whose
/// reader is paused checks that what it has not read ends with the close
/// frame to tell an orderly end from a lost connection).
///
/// Device memory (the staged path, below the rest of the engine). An
/// operation whose local or remote memory is `Device` moves as segments of
/// at most one chunk through pinned bounce buffers, on the side that owns
/// the memory: copies out (device-to-host into a tx slot, whose frame then
/// carries the segment) and in (the transport places a payload into an rx
/// slot, then a host-to-device copy), through the scheduler's `copy_engine`
/// (gdr/sched/copy_engine.hpp). Rendezvous data goes as several `data` frames
/// (offset, `last` flag), puts and gets as several requests. A receiver with
/// no free rx slot pauses reading. An operation finishes only when no copy
/// touches its memory and it holds no slot; slots freed from inside
/// `on_sent` let their waiters go on at the end of the event, never there.
///
/// Device memory with GPUDirect (`set_device_direct`). When the transport's
/// NIC reaches GPU memory, nothing is staged, and the CPU must never touch
/// `Device` memory: a send from it goes by rendezvous at any size (the
/// receiver's rtr carries its key and the sender's NIC writes), a `Device`
/// receive fails with `errc::gpudirect_unavailable` when an eager message
/// (already in host memory) would be copied into it, and the message stays
/// for the next receive; puts and gets touching `Device` memory on either
/// side, and the rtr of a `Device` receive, are marked for the transport
/// (`frame::nic_only`, `rx_plan::device`), which moves them by RDMA or
/// fails the connection with `errc::gpudirect_unavailable`, never copies.
///
/// Answers made for the peer are bounded (engine/answers.hpp): the
/// `rts_withdrawn` frames this side allocates to answer the peer's
/// `rts_cancel` (or an `rts` while closing) wait in the transport until the
/// peer reads; at most `unexpected_messages` of them, which a peer keeping
/// to its credits never reaches; past that the reader pauses until they
/// are written. That file lists every frame the engine makes for the peer
/// and what bounds each.
///
/// Credits. A put or get request holds one of the target's reply slots
/// until its answer is written. Each hello says how many the sender grants;
/// the other side keeps at most that many requests unanswered, and the rest
/// wait on the initiator's side, so puts and gets in both directions at
/// once never leave both readers waiting for a slot. The slots are
/// allocated when first needed; a request none can be allocated for is
/// answered `status::no_memory` from a spare slot (see "Reply slots").
///
/// Failure. When the transport fails (peer gone, protocol error) or the
/// endpoint closes, every pending and later operation fails with that
/// error, in order; messages already kept remain receivable.
///
/// The transport's side
/// ====================
/// A transport derives from `engine`, implements the `link_*` hooks, and
/// calls the `on_*` events, on the engine's thread, between `enter()` and
/// `leave()`:
///   * `link_post(frame&)`: queue a frame (a `header` and a payload
///     pointer) to be sent in order. Exactly one `on_sent(f, ec)` follows,
///     when the payload memory is no longer needed (written, or failed),
///     unless `link_withdraw(f)` took it back first. `link_committed(f)`:
///     it can no longer be withdrawn.
///   * Receiving is header first: for each frame the transport calls
///     `on_header(h)` before reading any payload byte; the plan it gets
///     says where the payload goes (`dst`, `want` bytes, then `discard`
///     bytes to drop), or to pause (nothing consumed: the transport offers
///     the same header again after `link_resume()`), or that the header is
///     a protocol error. After placing `want` bytes it calls `on_placed`.
///     `link_abort_target()` stops a placement early (a cancelled receive):
///     the transport drops the rest and says when the memory is free.
///   * Deferred placements. A transport whose placement runs on its own
///     (a GPU copy out of the peer's memory) may read on before it is
///     done: after `on_header`, `defer_placement()` takes the current
///     placement off the reader and gives a ticket, and
///     `on_deferred_placed(ticket, ok)` ends it later. The engine defers
///     only a whole operation's payload (matched when its header came) and
///     a put it serves into exposed memory (acked when done); a kept
///     message, a bounce buffer or a segment gets ticket 0 and is placed
///     in turn (`on_placed`). A stop does not abort a deferred placement:
///     the operation completes with its reason at once and finishes (its
///     memory is the user's again) when the transport gives it back; a
///     failure completes it with the error likewise. The transport decides
///     which later frames may pass a placement in flight (the ordering the
///     user sees: a close, a get or an atomic behind a put must not), and
///     ends its deferred placements in the order of their headers.
///   * `on_link_failed(ec)` once, when the connection breaks; then every
///     posted frame comes back through `on_sent` with an error.
///   * `link_shutdown()`: the engine failed or closed; stop the connection
///     (an abort).
///   * `link_close()`: the close frame was written, or the peer's arrived;
///     end the connection in order (a stream: end this side's half, then
///     read and drop what the peer still sends until its end). True: it is
///     ending, `link_quiet()` says when it has, and `link_shutdown()` may
///     follow to abort it; false (the default): it was shut down at once.
///   * `link_flush()`: the end of an outermost handler, after the ready
///     operations resumed (a transport writes what they queued).
///   * `link_quiet()`: no kernel request of the transport is in flight.
///
/// The re-entrancy rule: the engine never calls a `link_*` hook from
/// inside an event (between the transport's `enter()` and `leave()`,
/// where the transport may be walking its own queues). What an event
/// decides (posts, withdrawals, the abort of a placement, resuming the
/// reader, the shutdown) is queued and made, in order, at the end of the
/// outermost event, in `leave()`, before `link_flush()`. Outside every
/// event (an operation starting from its `await_suspend`) the hooks are
/// called at once; so are they from the coroutines the outermost event's
/// `leave()` resumes, after what the event queued (the transport walks
/// nothing then). There, a transport may take an eager frame whole at once
/// (`link_send_now`, the fast path): the send is then done before it
/// would suspend, and never queued. Debug builds assert the rule. Which
/// list an operation is on is recorded in the operation (`op::list_`),
/// never inferred from its stage; taking a node off a list it is not on is
/// an assertion. An operation's stage changes only through `op::to`, and
/// `op::may_move` is the one table of the moves each kind may make (debug
/// builds assert every move against it).
#pragma once

#include <gdr/protocol/engine/engine.hpp>
#include <gdr/protocol/engine/events.hpp>
#include <gdr/protocol/engine/event_scope.hpp>
#include <gdr/protocol/engine/life.hpp>
#include <gdr/protocol/engine/matching.hpp>
#include <gdr/protocol/engine/two_sided.hpp>
#include <gdr/protocol/engine/one_sided.hpp>
#include <gdr/protocol/engine/direct.hpp>
#include <gdr/protocol/engine/bounce_pool.hpp>
#include <gdr/protocol/engine/staged.hpp>
