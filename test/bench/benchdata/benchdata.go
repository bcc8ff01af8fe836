// Package benchdata is the schema of the results the benchmarks of test/bench write and
// test/bench/report reads: one type per file, and the file's name beside it, so that the writer
// and the reader cannot drift apart.
package benchdata

import "time"

// The files a results directory (-out) holds.
const (
	// E2EFile is BenchmarkEndToEnd's Results.
	E2EFile = "e2e.json"
	// BigFlowsFile is BenchmarkMillionFlows' BigFlows.
	BigFlowsFile = "bigflows.json"
	// ConntrackFile is BenchmarkConntrackMemory's rounds, a []ConntrackMemory.
	ConntrackFile = "conntrack.json"
	// LiveCIDRsFile is BenchmarkLiveCIDRs' swaps, a []LiveCIDRs.
	LiveCIDRsFile = "livecidrs.json"
)

// Results is what BenchmarkEndToEnd measured (E2EFile).
type Results struct {
	Machine Machine       `json:"machine"`
	Load    []LoadResult  `json:"load"`
	Apply   []ApplyResult `json:"apply"`
	Memory  []MemResult   `json:"memory"`
	// PacketCost is the BPF modes' cost per program run on real packets (kernel statistics).
	PacketCost []PacketCost `json:"packet_cost"`
	StartedAt  time.Time    `json:"started_at"`
}

// Machine describes where the numbers come from.
type Machine struct {
	Kernel string `json:"kernel"`
	CPUs   int    `json:"cpus"`
	CPU    string `json:"cpu"`
	Go     string `json:"go"`
}

// LoadResult is one mode under one CIDR set.
type LoadResult struct {
	Mode  string `json:"mode"`
	CIDRs int    `json:"cidrs"`
	// ConnRates are connections per second of each run; Slow those that took over a second.
	ConnRates []float64 `json:"conn_rates"`
	Slow      []int64   `json:"slow"`
	Errors    []int64   `json:"errors"`
	// SYNRetrans are the SYNs the pod sent again in each run (its TcpExtTCPSynRetrans): most
	// after the far side answered with a bare ACK, which costs the connection a few ms, not a
	// second, so Slow misses them.
	SYNRetrans []int64 `json:"syn_retrans"`
	// Connections are those each run completed, and CPUSeconds the system and softirq time the
	// machine spent meanwhile (/proc/stat, every CPU): the pod's and the external host's
	// sockets, the node's forwarding and NAT, and the agent.
	Connections []int64   `json:"connections"`
	CPUSeconds  []float64 `json:"cpu_seconds"`
	// Throughputs are bulk TCP bits per second of each run.
	Throughputs []float64 `json:"throughputs"`
}

// ApplyResult is the time from writing a config to the datapath holding it.
type ApplyResult struct {
	Mode  string `json:"mode"`
	CIDRs int    `json:"cidrs"`
	// Kind is "first" (from the defaults to n CIDRs) or "replace" (n CIDRs by n others).
	Kind    string  `json:"kind"`
	Seconds float64 `json:"seconds"`
}

// MemResult is the agent's resident memory.
type MemResult struct {
	Mode       string `json:"mode"`
	State      string `json:"state"`
	RSSBytes   int64  `json:"rss_bytes"`
	NATEntries int    `json:"nat_entries,omitempty"`
}

// PacketCost is what one of our programs cost per run on the uplink during one kind of load,
// from the kernel's own BPF run-time statistics (BPF_ENABLE_STATS: two clock reads around each
// run, in the real hook). It is the per-packet figure BPF_PROG_TEST_RUN cannot give: no
// test-run floor, real packets (GSO super-packets in bulk), the mix of new and established
// flows a short-connection load has.
type PacketCost struct {
	Mode  string `json:"mode"`
	CIDRs int    `json:"cidrs"`
	// Load is "connections" (the short-connection load) or "bulk" (one iperf3 stream).
	Load string `json:"load"`
	// Dir is "egress" or "ingress".
	Dir      string  `json:"dir"`
	Runs     uint64  `json:"runs"`
	NsPerRun float64 `json:"ns_per_run"`
}

// BigFlows is what BenchmarkMillionFlows measured (BigFlowsFile).
type BigFlows struct {
	Flows         int     `json:"flows"`
	NATMaxEntries int     `json:"nat_max_entries"`
	FillSeconds   float64 `json:"fill_seconds"`
	// Entries are the NAT entries dump counted after the fill (two per flow), by state.
	Entries     int            `json:"entries"`
	EntryStates map[string]int `json:"entry_states"`
	// Idle and Full are the agent's steady state with the table empty and full: CPU seconds
	// over Window (sweeps, drift checks every second, a scrape every 15 s); FullAfter are the
	// windows that follow Full, one after the other, so that every window of a walk's period
	// (longer than one window) is seen.
	Window    float64      `json:"window_seconds"`
	Idle      SteadyPart   `json:"idle"`
	Full      SteadyPart   `json:"full"`
	FullAfter []SteadyPart `json:"full_after,omitempty"`
	// Dump is how long `dump` took on the full table, each run.
	DumpSeconds []float64 `json:"dump_seconds"`
	// Restart is the agent started again over the full table, -big-runs times; Resize started
	// again with --nat-max-entries at ResizeTo, back at NATMaxEntries, and so on.
	Restart  []Restart `json:"restart"`
	Resize   []Restart `json:"resize"`
	ResizeTo int       `json:"resize_to"`
	// KernelBytes is the kernel's memory of each NAT map at the full table (fdinfo's memlock).
	KernelBytes map[string]int64 `json:"kernel_bytes"`
	RSSBytes    int64            `json:"rss_bytes"`
}

// SteadyPart is one steady-state window.
type SteadyPart struct {
	CPUSeconds float64 `json:"cpu_seconds"`
	// ScrapeMs is each scrape's time; SweepMs each sweep's, as the agent logged it.
	ScrapeMs []float64 `json:"scrape_ms"`
	SweepMs  []float64 `json:"sweep_ms"`
}

// Restart is one restart of the agent over a full table, with --nat-max-entries at
// NATMaxEntries: the seconds to ready, to the migration's end when the table was resized, and
// the entries dump counted afterwards.
type Restart struct {
	NATMaxEntries  int     `json:"nat_max_entries"`
	ReadySeconds   float64 `json:"ready_seconds"`
	CarriedSeconds float64 `json:"carried_seconds,omitempty"`
	Entries        int     `json:"entries"`
}

// ConntrackMemory is one round of BenchmarkConntrackMemory (ConntrackFile): the kernel's slab
// memory that the connections took, per connection: PerConn counts nf_conntrack's cache and the
// kmalloc caches (where the NAT extension lands), ByCache every cache that grew by more than a
// byte per connection meanwhile (others are the rest of the machine's doing), and conntrack's hash
// tables.
type ConntrackMemory struct {
	Flows       int                `json:"flows"`
	Connections int                `json:"connections"`
	PerConn     float64            `json:"per_conn_bytes"`
	ByCache     map[string]float64 `json:"by_cache"`
	// ObjectSize is nf_conntrack's object size; Buckets and Max the node's nf_conntrack_buckets
	// and nf_conntrack_max (the hash heads are 8 bytes per bucket, for conntrack and for NAT).
	ObjectSize int `json:"object_size"`
	Buckets    int `json:"buckets"`
	Max        int `json:"max"`
}

// LiveCIDRs is one backend's swaps in BenchmarkLiveCIDRs (LiveCIDRsFile).
type LiveCIDRs struct {
	Mode  string `json:"mode"`
	CIDRs int    `json:"cidrs"`
	// Changed is how many of the CIDRs each swap replaces: all of them (a new set), or a few
	// (an edit of the ConfigMap); 0 in results from before the edits were measured: all.
	Changed int `json:"changed"`
	// Verdict is, for each swap, the seconds from the ..data swap to the first new flow that got
	// the new verdict; Applied to the agent's "policy applied" log line.
	Verdict []float64 `json:"verdict_seconds"`
	Applied []float64 `json:"applied_seconds"`
	// Probes is how many new flows the swaps sent in all, one a millisecond.
	Probes int `json:"probes"`
}
