// The broker's state: named segments, who may do what with them, and which connection holds which reference.
// Pure bookkeeping, no I/O: the server (server.hpp) feeds it decoded requests and sends what it returns.
#pragma once

#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "broker/exit_watch.hpp"
#include "broker/journal.hpp"
#include "broker/repair.hpp"
#include "gpuipc/error.hpp"
#include "os/fd.hpp"
#include "os/memfd.hpp"
#include "os/socket.hpp"
#include "proto/messages.hpp"
#include "proto/shm.hpp"
#include "proto/status_page.hpp"

namespace gpuipc::broker {

using ConnId = std::uint64_t;

/// Limits the registry enforces per uid.
struct Quotas {
  std::uint64_t bytes = UINT64_MAX;  ///< bytes of registered segments one uid may own
  std::uint64_t segments = 4096;     ///< registered segments one uid may own
  /// Segments (each an fd the broker holds) all uids together may have registered: the broker's fd budget, set
  /// from its RLIMIT_NOFILE. One uid may take at most half of it, so one user cannot lock the others out.
  std::uint64_t fds = 1U << 20;
  std::size_t pending_opens_per_connection = 64;  ///< opens parked waiting for a name, per connection
  /// References one connection may hold to one segment: far above what a process takes (its library shares a
  /// mapping's reference between handles), far below what would wrap the u32 counts.
  std::uint32_t refs_per_connection = 1U << 20;
  /// Owed stream writes (16 bytes each) the broker keeps for the channels one uid owns together, each looked at on
  /// every pass of its timer (every 1 to 32 ms) until it is made: 64 full tables of the largest channel's. Past it,
  /// what a dying member owes is written at once.
  std::size_t owed_writes = std::size_t{proto::kMaxMembers} * proto::owed_capacity(proto::kMaxSlots);
  /// Segments one uid's connections may hold references to together, each (segment, connection) counted once
  /// (GPUIPC_QUOTA_OPENS): the broker keeps some 300 bytes for each (references, writers, heartbeat, the
  /// connection's index), so that one uid's 512 connections opening its 4096 segments would take it 600 MB.
  std::size_t opens = 65536;
  /// The same over every uid (GPUIPC_QUOTA_OPENS_TOTAL): the per-uid bound multiplies by the uids that connect,
  /// and one user with subordinate uids (/etc/subuid, a rootless container's) has many. About 300 MB at the default.
  std::size_t opens_total = std::size_t{1} << 20;
};

/// Who is asking: a connection and its SO_PEERCRED credentials.
struct Caller {
  ConnId conn = 0;
  os::Credentials creds;
};

/// One message to send: to `conn`, answering `request_id`, with an optional fd (owned: dup'ed or reopened).
struct Outgoing {
  ConnId conn = 0;
  proto::Message msg;
  os::UniqueFd fd;
};

/// One registered segment: its attributes (journal.hpp) and what the broker holds of it.
struct SegmentRecord : SegmentAttributes {
  std::uint64_t id = 0;
  os::UniqueFd memory;                      ///< keeps the memory alive while registered
  os::Mapping control;                      ///< semaphores and channels: the broker's view, for repairs
  ControlBlock block;                       ///< over `control`, with the geometry read once at Create
  std::map<ConnId, std::uint32_t> refs;     ///< references per connection (Quotas::refs_per_connection)
  std::set<ConnId> writers;                 ///< connections holding a read-write reference
  std::set<ConnId> lookers;  ///< connections whose references are all looks (Access::Look): no events, not holders
  std::multimap<ConnId, Joined> joined;     ///< member entries each connection joined (Join)
  /// After a broker restart: member entries the journal says the last broker's clients held and nobody has
  /// rejoined yet. Each is repaired once its process is gone (`process` exited, or it was gone already); one whose
  /// process this broker cannot see (pid 0) waits for its Rejoin, or for the name to go.
  struct Unclaimed {
    Joined joined;
    ProcessWatch process;
    /// In `exiting`: a pool member that left (Leave) while its stream had not reached some of its frees; repaired
    /// as soon as they have landed, or its process has exited.
    bool left = false;
    /// In `exiting`: a member whose connection closed while its process lived (a connection the broker cut, one its
    /// library dropped): repaired at this time (monotonic ns) unless its process rejoins first (its library
    /// reconnects at once), or once it exits if that comes sooner. 0: it waits for its exit alone.
    std::int64_t rejoin_by_ns = 0;
  };
  std::vector<Unclaimed> unclaimed;
  /// Member entries of connections that closed whose repair waits for their process to exit (repair.hpp,
  /// repair_waits_for_exit), or for it to exit or rejoin (a process that lives on: Unclaimed::rejoin_by_ns). And
  /// pool members that left owing stream frees.
  std::vector<Unclaimed> exiting;
  ConnId creator = 0;                       ///< the connection that created it
  /// A device_ipc share whose exporter's connection closed while its process ran (the broker cut it, or its library
  /// dropped it): the name and the record stay, and the process may announce the share again (its library
  /// reconnects at once) and be its exporter again. The share ends (exporter_left) once that process exits, or at
  /// `back_by_ns` (monotonic) if it has not announced it by then: a process that exec'd never does.
  struct ExporterAway {
    ProcessWatch process;
    pid_t pid = 0;
    std::int64_t back_by_ns = 0;
  };
  std::optional<ExporterAway> exporter_away;
  /// device_ipc: the exporter's process (its pid, and its start: os::process_start_ticks, 0 unknown), journaled so
  /// that a broker started after this one died knows whose exit ends the share.
  pid_t exporter_pid = 0;
  std::uint64_t exporter_start = 0;
  std::set<ConnId> watchers;  ///< connections that watch it (Watch)
  struct Beat {
    std::int64_t deadline_ns = 0;  ///< the next Heartbeat is due by then
    std::uint32_t ms = 0;          ///< the deadline it promised
    bool hung = false;             ///< it missed the deadline (watchers were told)
  };
  std::map<ConnId, Beat> beats;  ///< heartbeats of connections that hold it
  std::size_t owed_charged = 0;  ///< owed writes of its block counted in its owner's Quotas::owed_writes
  /// A control block, or a device_ipc share, unlinked while processes hold it (a share: or while its exporter is
  /// away): its key (journal.hpp, unlinked_key), by which a holder's Announce finds it and under which the journal
  /// keeps it, its members and what they owe. Empty otherwise.
  std::string unlinked_key;
  std::uint32_t total_refs() const noexcept;
  /// What the journal records it under: its name, or its unlinked_key (empty: not journaled).
  const std::string& journal_name() const noexcept { return name.empty() ? unlinked_key : name; }
};

/// How logs name `seg`: its name, or what an unlinked control block is.
std::string shown(const SegmentRecord& seg);

/// Takes group and other access off memfd `fd`'s inode (it is checked to be a memfd first), so that an opener given
/// a read-only description cannot reopen it writable through /proc/self/fd. Returns why it cannot, or empty.
std::string keep_to_owner(int fd);

/// Checks the record memfd of a DeviceIpc Create (exact size, then sealed; proto::check_device_ipc_record against
/// `req`; exporter_gone clear) and maps it read-write into `out` for exporter_left. Returns an empty string when
/// valid, else why not. Defined in broker/adopted.cpp.
std::string adopt_device_ipc_record(const proto::Create& req, int fd, os::Mapping& out);

/// Maps the control block of a semaphore, channel, pool or counting semaphore (`seg.flags` != 0, `seg.size` bytes)
/// from `fd` into `seg.control` and checks it (check_control; `fresh`: at Create, else a name given back after a
/// broker restart). Returns an empty string when valid, else the error to send, with its code in `code`.
std::string map_control(SegmentRecord& seg, int fd, bool fresh, ErrorCode& code);

/// One message to `conn` answering `rid` (0: an Event), with an optional fd.
Outgoing reply(ConnId conn, std::uint32_t rid, proto::Body body, os::UniqueFd fd = {});

/// The wall clock in nanoseconds since the Unix epoch (creation times, Events).
std::uint64_t unix_now_ns() noexcept;

class Registry {
 public:
  /// Creates the status page (proto/status_page.hpp). Throws Error(System).
  explicit Registry(Quotas quotas);

  /// Writes how this broker was started into the status page (its start time is now). Call once, before the
  /// page is shared with any client.
  void describe_broker(proto::BrokerMode mode, std::uint64_t idle_timeout_ms) noexcept;

  /// Says on the status page that this broker is stopping on purpose (before it closes the connections): clients
  /// then start no broker by themselves, as they do after it died.
  void mark_stopping() noexcept;

  /// The status page's memfd; the server hands a read-only reopen of it to each client with HelloReply.
  int status_fd() const noexcept { return m_status_fd.get(); }

  /// A connection said Hello: remember its credentials (SO_PEERCRED and SO_PEERGROUPS; nothing the client states).
  void add_connection(ConnId conn, const os::Credentials& creds);
  /// A connection ended (clean close or crash): drop its references (freeing unlinked segments with no
  /// references left) and cancel its pending opens. With `repair`, semaphores and channels it was a member of are
  /// repaired (a broker shutting down does not repair: its clients live on).
  /// With `out`, the watchers of every segment it held are told that its process died (Event).
  void drop_connection(ConnId conn, bool repair = true, std::vector<Outgoing>* out = nullptr);

  /// Handles one request of an established connection; appends replies (to this and, for Create, to waiting
  /// openers) to `out`. `fds` are the fds that came with the request (ownership taken where used).
  void handle(const Caller& caller, const proto::Message& request, std::vector<os::UniqueFd>& fds,
              std::int64_t now_ns, std::vector<Outgoing>& out);

  /// Answers pending opens whose deadline passed with Timeout errors.
  void expire(std::int64_t now_ns, std::vector<Outgoing>& out);
  /// The earliest pending-open deadline, if any.
  std::optional<std::int64_t> next_deadline() const;
  /// Sets the quotas (the server lowers `fds` to what its RLIMIT_NOFILE allows).
  void set_quotas(const Quotas& quotas) noexcept { m_quotas = quotas; }
  /// How long a member whose connection closed while its process lives waits to rejoin before it is repaired. 0: it
  /// is repaired at once, its connection's close taken for its process's death.
  void set_rejoin_grace(std::int64_t grace_ns) noexcept { m_rejoin_grace_ns = grace_ns; }
  const Quotas& quotas() const noexcept { return m_quotas; }
  /// How many times the broker has polled a process it waits for (ExitWatch::looks; for tests).
  std::uint64_t exit_looks() const noexcept { return m_exits.looks(); }

  /// Opens the names journal at `path`: the names linked when the last broker died wait until `now_ns + grace_ns`
  /// for a process that still maps one to Announce it (restore.cpp). Throws Error(System).
  void open_journal(const std::string& path, std::int64_t now_ns, std::int64_t grace_ns);
  /// Names from the journal no holder has announced yet.
  std::size_t restorable_count() const noexcept { return m_restore.size(); }

  /// Whether nothing is registered (the broker may idle-exit).
  bool empty() const noexcept { return m_segments.empty() && m_restore.empty(); }
  std::size_t segment_count() const noexcept { return m_segments.size(); }
  /// Sum of references over all segments and connections (tests and `gpuipc ls`).
  std::size_t total_references() const noexcept;
  std::size_t pending_count() const noexcept { return m_pending.size(); }

 private:
  // An open parked until its name appears, indexed by deadline and by name (iterators into both, which stay
  // valid), so that neither a Create nor a timer scans every parked open.
  struct Pending {
    ConnId conn;
    std::uint32_t request_id;
    proto::Open request;
    os::Credentials creds;
    std::multimap<std::int64_t, std::uint64_t>::iterator by_deadline;
    std::multimap<std::string, std::uint64_t>::iterator by_name;
  };

  void create(const Caller& caller, std::uint32_t rid, const proto::Create& req, std::vector<os::UniqueFd>& fds,
              std::vector<Outgoing>& out);
  void open(const Caller& caller, std::uint32_t rid, const proto::Open& req, std::int64_t now_ns,
            std::vector<Outgoing>& out);
  /// Opens an existing segment for the caller (permission check, reference, reply with fd).
  void open_existing(SegmentRecord& seg, ConnId conn, const os::Credentials& creds, std::uint32_t rid,
                     proto::Access access, std::vector<Outgoing>& out);
  void close(const Caller& caller, std::uint32_t rid, const proto::Close& req, std::vector<Outgoing>& out);
  void unlink(const Caller& caller, std::uint32_t rid, const proto::Unlink& req, std::vector<Outgoing>& out);
  /// Unlink by segment id: only while segment `req.id` still has a name (never one made since under that name).
  void unlink_id(const Caller& caller, std::uint32_t rid, const proto::UnlinkId& req, std::vector<Outgoing>& out);
  /// Removes the name of `seg` (which has one) for `caller`, when the caller owns it or is root; answers either way.
  void unlink_segment(const Caller& caller, std::uint32_t rid, SegmentRecord& seg, std::vector<Outgoing>& out);
  void stat(const Caller& caller, std::uint32_t rid, const proto::Stat& req, std::vector<Outgoing>& out);
  void list(const Caller& caller, std::uint32_t rid, const proto::List& req, std::vector<Outgoing>& out);
  void join(const Caller& caller, std::uint32_t rid, const proto::Join& req, std::vector<Outgoing>& out);
  void announce(const Caller& caller, std::uint32_t rid, const proto::Announce& req, std::vector<os::UniqueFd>& fds,
                std::vector<Outgoing>& out);
  void rejoin(const Caller& caller, std::uint32_t rid, const proto::Rejoin& req, std::vector<Outgoing>& out);
  /// A channel member of this connection leaves while its stream still owes writes: removed now (Closed), its
  /// writes made by its stream or, once its process has exited, by the broker as their turns come (repair.hpp,
  /// leave_member). A pool member: removed once its frees land or its process exits. A semaphore signaller: removed
  /// now.
  void leave(const Caller& caller, std::uint32_t rid, const proto::Leave& req, std::vector<Outgoing>& out);
  void holders(const Caller& caller, std::uint32_t rid, const proto::Holders& req, std::vector<Outgoing>& out);
  void watch(const Caller& caller, std::uint32_t rid, const proto::Watch& req, std::vector<Outgoing>& out);
  void heartbeat(const Caller& caller, std::uint32_t rid, const proto::Heartbeat& req, std::int64_t now_ns,
                 std::vector<Outgoing>& out);
  /// What `conn` is to `seg`: its pid, references, access, roles and heartbeat.
  proto::HolderInfo holder_of(const SegmentRecord& seg, ConnId conn) const;
  /// Tells `seg`'s watchers (but `conn` itself) that `conn` joined, left, died, hung or beat again.
  void notify(const SegmentRecord& seg, proto::EventKind kind, const proto::HolderInfo& holder, ConnId conn,
              std::vector<Outgoing>& out);
  /// Marks heartbeats whose deadline passed as hung and tells watchers.
  void expire_beats(std::int64_t now_ns, std::vector<Outgoing>& out);
  /// Connection `conn` of a holder of `seg` closed: tells the watchers it died, at once when its process has exited,
  /// else once it exits or the rejoin grace runs out with it not back (PendingDeath).
  void report_death(const SegmentRecord& seg, ConnId conn, std::vector<Outgoing>& out);
  /// Tells watchers of the pending deaths whose process has exited or whose grace ran out (when due).
  void report_pending_deaths(std::int64_t now_ns, std::vector<Outgoing>& out);
  /// Records whether `conn` holds references to segment `id` (SegmentRecord::refs), for drop_connection, and
  /// counts it in its uid's Quotas::opens.
  void note_holding(ConnId conn, std::uint64_t id, bool holds) noexcept;
  /// Why `conn` may not start holding `name` (its uid's connections hold Quotas::opens segments, or every uid's
  /// Quotas::opens_total), or empty.
  std::string opens_refusal(ConnId conn, const std::string& name) const;
  /// Why `conn` may not take another reference to `seg` (Open, Announce): it holds Quotas::refs_per_connection of
  /// them, or holds none and opens_refusal says no. Empty when it may.
  std::string reference_refusal(const SegmentRecord& seg, ConnId conn) const;
  /// What `name` stands for now: a linked segment's attributes, or a name from before a restart that waits for
  /// its Announce; nullptr when it is neither.
  const SegmentAttributes* named(const std::string& name) const;
  /// Why `creds` may not create `name`, or empty. Names under an existing object's name (`P.x` while `P` exists)
  /// are for those who may read it, and a pool's chunk names (proto::pool_of_chunk) for those who may read and
  /// write the pool: a member that finds a chunk's name taken used to map what is there as the chunk (another
  /// user's segment would then hold the pool's data), and a stream publisher waited for ever on a reader slot that
  /// someone who may not read the stream made.
  std::string name_refusal(const os::Credentials& creds, const std::string& name) const;
  /// Why `creds` may not create `pool` (a pool's control block, mapped): one of its chunk names is held by another
  /// uid, made before the pool existed; or empty.
  std::string pool_chunks_refusal(const os::Credentials& creds, const SegmentRecord& pool) const;
  /// Removes `conn`'s heartbeat on `seg` (all of them when `conn` is 0), and their deadlines.
  void drop_beats(SegmentRecord& seg, ConnId conn = 0) noexcept;
  /// Records a new linked name in the journal (a device_ipc share with its exporter's process).
  void journal_linked(const SegmentRecord& seg) noexcept;
  /// The journal's lines for `seg` as it is now (its entry, member entries and owed writes), or empty when it is not
  /// journaled (maybe_compact_journal).
  std::string journal_lines(const SegmentRecord& seg) const;
  /// `name`, the name of `seg`, was removed (seg.name is empty now). A control block that processes still hold, or a
  /// device_ipc share held or whose exporter is away, is keyed and journaled under its unlinked_key before the name's
  /// removal is: its members' deaths are repaired after a broker restart too (restore.cpp), and a share's exporter
  /// finds it by its record.
  void journal_unlinked(SegmentRecord& seg, const std::string& name) noexcept;
  /// Drops `name`, a journal name waiting for a holder's Announce (its owner unlinked it, or nobody announced it in
  /// time). With `keep`, a control block (or a device_ipc share) goes on waiting under its unlinked_key, with its
  /// members and owed writes.
  void drop_restore(const std::string& name, bool keep);
  /// Answers the opens parked on `seg`'s name.
  void wake_waiting(SegmentRecord& seg, std::vector<Outgoing>& out);
  /// Drops journal names nobody announced within the grace time.
  void expire_restores(std::int64_t now_ns);
  /// Checks the memory fd of a Create for its kind; empty, or what is wrong.
  std::string check_memory(const proto::Create& req, int fd);
  /// Registers `seg` (its id, memory and first reference set): its name, the owner's quota use, the journal.
  /// Returns the stored record.
  SegmentRecord& link(SegmentRecord seg);
  void park(const Caller& caller, std::uint32_t rid, const proto::Open& req, std::int64_t now_ns,
            std::vector<Outgoing>& out);
  /// Removes parked open `id` from every index; returns it.
  Pending unpark(std::uint64_t id);
  /// Whether `creds` may see `seg` in stat and list: root, the owner, or read permission (like a directory entry).
  static bool visible_to(const os::Credentials& creds, const SegmentRecord& seg) noexcept;
  /// The segment linked under `name` if `creds` may see it, else nullptr (as if there were none).
  SegmentRecord* find_visible(const os::Credentials& creds, const std::string& name);
  proto::SegmentInfo info_of(const SegmentRecord& seg) const;
  /// Removes the segment if it is unlinked and nobody references it.
  void maybe_destroy(std::uint64_t id);
  /// Connection `conn` holds no more references to `seg`: remove the members it joined (if they did not leave).
  /// `lost`: the connection closed (rather than Close of its last reference), so its process may live on and rejoin.
  void repair_for(SegmentRecord& seg, ConnId conn, bool lost);
  /// Makes the owed stream writes of dead channel members whose turn has come (repair.hpp, settle_owed), when due.
  void settle_owing(std::int64_t now_ns);
  /// A control block came back after a broker restart (restore.cpp): takes the journal's member entries of its name
  /// that still hold their token as unclaimed, repairing at once those whose process is gone.
  void adopt_unclaimed(SegmentRecord& seg);
  /// Repairs unclaimed member entries whose process has exited since (when due: every kUnclaimedLookNs).
  void repair_unclaimed(std::int64_t now_ns);
  /// Repairs the members waiting in SegmentRecord::exiting whose process has exited, or (pool members that left)
  /// whose stream frees have landed (when due: every 1 ms).
  void repair_exited(std::int64_t now_ns);
  /// Puts `u` in seg.exiting and has repair_exited look at it.
  void repair_later(SegmentRecord& seg, SegmentRecord::Unclaimed u);
  /// Has repair_exited look at `seg` 1 ms from now, however long the others have waited.
  void look_at_exiting_soon(const SegmentRecord& seg);
  /// Device_ipc `seg` has no connection of its exporter (it lost it, or the broker restarted): when the exporter's
  /// process still runs, keeps the share for it (SegmentRecord::exporter_away) and returns true; false when the share
  /// ends now (the caller calls exporter_left).
  bool await_exporter(SegmentRecord& seg);
  /// Ends the share of `seg` if its away exporter has exited or let the grace run out; true when it ended.
  bool exporter_back_or_gone(SegmentRecord& seg, std::int64_t now_ns);
  /// Repairs one member entry of `seg` no connection holds (its process is gone) and journals it.
  void repair_gone(SegmentRecord& seg, const Joined& member);
  /// Removes `member` from `seg` (remove_member: `process`, empty when exited or not to be waited for) and journals
  /// that it left, with the stream writes still owed after it.
  void repair_member(SegmentRecord& seg, const Joined& member, const ProcessWatch& process = {});
  /// A watch of process `pid` (started at `start`, 0: any) for `uid`, within the uid's share of the broker's fds
  /// (ExitWatch::watch; its segments take the rest of the share).
  ProcessWatch watch_process(pid_t pid, std::uint64_t start, uid_t uid) noexcept;
  /// The broker's fds one uid may take: its segments and the processes watched for it together.
  std::uint64_t fds_per_uid() const noexcept { return std::max<std::uint64_t>(m_quotas.fds / 2, 1); }
  /// The stream writes dead members of `seg` still owe, and the processes they wait for, as the journal records them.
  JournalOwed owed_of(const SegmentRecord& seg) const;
  /// Journals `writes`, owed stream writes one member of `seg` added, which wait for `process` (empty: none).
  void journal_owed(const SegmentRecord& seg, std::vector<proto::OwedWrite> writes, const ProcessWatch& process);
  /// Looks at `seg` again for owed writes to make (settle_owing) while it has any, and counts them for its owner.
  void watch_owed(SegmentRecord& seg);
  /// Counts the owed writes `seg` keeps now in its owner's share (Quotas::owed_writes). Throws std::bad_alloc only
  /// when the count grows.
  void charge_owed(SegmentRecord& seg);
  /// Lets `seg`'s block keep no more owed writes than its owner's share has room for (ControlBlock::most_owed).
  void limit_owed(SegmentRecord& seg) noexcept;
  /// A channel came back after a broker restart: takes the stream writes the journal says its dead members still
  /// owed (made as their turns come, once the processes they wait for have exited).
  void restore_owed(SegmentRecord& seg);
  /// The start (os::process_start_ticks) of connection `conn`'s process, read once a connection; 0 when unknown.
  std::uint64_t process_start_of(ConnId conn) noexcept;
  /// Records in `member` which process joined it (connection `conn`'s), and journals it (named blocks only).
  void journal_joined(const SegmentRecord& seg, Joined& member, ConnId conn) noexcept;
  /// Compacts the journal from what is linked and joined now, when it has grown enough (Journal::wants_compaction).
  void maybe_compact_journal() noexcept;

  void bump_names_generation() noexcept;
  /// The creator of `seg` dropped its last reference or its connection: exporter_left, and a counting semaphore's
  /// grant it never joined to take is given back (creator_gone).
  void creator_left(SegmentRecord& seg, proto::PoisonReason why);
  /// The creator of a DeviceIpc segment dropped its last reference, or its process is gone (await_exporter): the
  /// memory dies with it.
  /// Unlinks the name and writes exporter_gone = `why` into the record (broker/adopted.cpp).
  void exporter_left(SegmentRecord& seg, proto::PoisonReason why);

  Quotas m_quotas;
  ExitWatch m_exits;
  os::UniqueFd m_status_fd;
  os::Mapping m_status_map;
  std::uint64_t m_next_id = 1;
  std::map<std::uint64_t, SegmentRecord> m_segments;      // by id (ordered: List pages by id)
  std::unordered_map<std::string, std::uint64_t> m_names;  // linked names -> id
  std::unordered_map<std::string, std::uint64_t> m_unlinked_keys;  // SegmentRecord::unlinked_key -> id
  // Per uid with connections: how many, and the segments they hold references to (Quotas::opens).
  struct UidOpens {
    std::size_t connections = 0;
    std::size_t held = 0;
  };
  std::unordered_map<uid_t, UidOpens> m_uid_opens;
  std::size_t m_opens_held = 0;  // UidOpens::held summed over every uid (Quotas::opens_total)
  struct ConnectionInfo {
    os::Credentials creds;
    std::set<std::uint64_t> pending;  // parked opens
    std::set<std::uint64_t> watching;  // segments it watches
    std::set<std::uint64_t> holding;   // segments it holds references to: what its close looks at
    bool holding_complete = true;      // false once an insert into `holding` failed (out of memory)
    std::size_t held = 0;              // segments it holds references to, counted in `uid` (whatever `holding` has)
    UidOpens* uid = nullptr;           // its uid's entry in m_uid_opens (none: a connection never added)
    std::optional<std::uint64_t> start;  // its process's start (os::process_start_ticks), read at its first Join
  };
  std::unordered_map<ConnId, ConnectionInfo> m_connections;
  std::map<std::uint64_t, Pending> m_pending;
  std::multimap<std::int64_t, std::uint64_t> m_pending_by_deadline;
  std::multimap<std::string, std::uint64_t> m_pending_by_name;
  std::uint64_t m_next_pending = 1;
  std::uint32_t m_next_token = 1;
  struct Restore {
    JournalEntry entry;
    std::int64_t deadline_ns = 0;
  };
  Journal m_journal;
  std::map<std::string, Restore> m_restore;  // journal names (and unlinked_keys) waiting for a holder's Announce
  std::map<std::string, std::vector<JournalMember>> m_restore_members;  // their member entries, by name
  std::map<std::string, JournalOwed> m_restore_owed;  // the stream writes their dead members owed, by name
  // Segments with unclaimed member entries whose process lives (SegmentRecord::unclaimed), looked at every 20 ms.
  static constexpr std::int64_t kUnclaimedLookNs = 20'000'000;
  std::set<std::uint64_t> m_unclaimed;
  std::int64_t m_unclaimed_check_ns = 0;
  // Segments with members whose repair waits for their process to exit (SegmentRecord::exiting), looked at 1 ms
  // after one is added or a process exits, backing off to 32 ms while none exits.
  static constexpr std::int64_t kExitingLookNs = 1'000'000;
  static constexpr std::int64_t kExitingLookMaxNs = 32'000'000;
  std::int64_t m_exiting_interval_ns = kExitingLookNs;
  std::set<std::uint64_t> m_exiting;
  std::int64_t m_exiting_check_ns = 0;
  std::int64_t m_rejoin_grace_ns = 5'000'000'000;  // ServerOptions::rejoin_grace
  // Pool members that left owing frees (SegmentRecord::Unclaimed::left): their pools' records are read (up to a
  // pool's whole table, which its members size) 1 ms after a leave or a landing, backing off to 32 ms while none
  // lands. Their processes' exits are looked at every pass, as above.
  static constexpr std::int64_t kFreesLookMaxNs = 32'000'000;
  std::int64_t m_frees_check_ns = 0;
  std::int64_t m_frees_interval_ns = kExitingLookNs;
  // Holders whose connection closed while their process ran (report_death): watchers are told they died once the
  // process exits, or when the rejoin grace runs out; nothing when the process gives the segment back (Announce) on
  // a new connection first. Looked at 1 ms after one is added or one is reported, backing off to 32 ms.
  struct PendingDeath {
    std::uint64_t id = 0;
    proto::HolderInfo holder;
    ProcessWatch process;
    std::int64_t report_by_ns = 0;
  };
  std::vector<PendingDeath> m_pending_deaths;
  std::int64_t m_deaths_check_ns = 0;
  std::int64_t m_deaths_interval_ns = kExitingLookNs;
  // Every heartbeat not hung, by deadline (deadline, segment id, connection): expire_beats and next_deadline look
  // at the first ones only, whatever the number of heartbeats (one uid may hold millions).
  std::set<std::tuple<std::int64_t, std::uint64_t, ConnId>> m_beat_deadlines;
  // Channels whose dead members still owe stream writes, and when to look at them next: 1 ms after a death or a
  // write made, backing off to 32 ms while none lands (a survivor's stream holds one back).
  static constexpr std::int64_t kOwedFirstLookNs = 1'000'000;
  static constexpr std::int64_t kOwedLastLookNs = 32'000'000;
  std::set<std::uint64_t> m_owing;
  std::int64_t m_owed_check_ns = 0;
  std::int64_t m_owed_interval_ns = kOwedFirstLookNs;
  std::unordered_map<uid_t, std::uint64_t> m_segments_per_uid;
  std::unordered_map<uid_t, std::uint64_t> m_bytes_per_uid;
  std::unordered_map<uid_t, std::size_t> m_owed_per_uid;  // SegmentRecord::owed_charged, by owner
};

/// The permission bits (r=4, w=2) `creds` has on an object of `mode` owned by uid/gid, like a file (the group
/// class applies to the peer's primary and supplementary groups).
unsigned permission_bits(const os::Credentials& creds, std::uint16_t mode, uid_t owner_uid, gid_t owner_gid) noexcept;

/// Builds an ErrorReply message.
proto::Message error_reply(std::uint32_t request_id, ErrorCode code, std::string message, int sys_errno = 0);

}  // namespace gpuipc::broker
