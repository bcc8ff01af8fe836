package bpf

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Timeouts say how long an idle flow is kept, by protocol and state.
type Timeouts struct {
	// TCPEstablished: both directions seen, no FIN or RST.
	TCPEstablished time.Duration
	// TCPOpening: only one direction seen yet (e.g. a SYN with no answer).
	TCPOpening time.Duration
	// TCPClosing: a FIN or RST seen. Long enough that a pod reusing its port after TIME_WAIT
	// still finds its mapping (and the far side sees the same port again).
	TCPClosing time.Duration
	UDP        time.Duration
	ICMP       time.Duration
	// Other covers every other protocol (address-only mappings; SCTP, DCCP and UDP-Lite by
	// their ports).
	Other time.Duration
}

// TimeoutKey is one of the Timeouts: its name (its key in --nat-timeouts), the conntrack
// timeout it stands for (a sysctl under ConntrackSysctlDir) and conntrack's default of it.
type TimeoutKey struct {
	Name      string
	Sysctl    string
	Conntrack time.Duration
	field     func(*Timeouts) *time.Duration
}

// Of is the timeout of t the key names.
func (k TimeoutKey) Of(t *Timeouts) *time.Duration { return k.field(t) }

// TimeoutKeys are the Timeouts, each with the conntrack timeout it stands for. Conntrack times
// a TCP connection by more states than these: opening is a SYN's (syn_sent), closing is
// TIME_WAIT's, the longest of its closing states; UDP is a flow's once replied (udp_timeout_stream,
// where conntrack gives one never replied udp_timeout, 30 s); ICMP and ICMPv6 share one.
var TimeoutKeys = []TimeoutKey{
	{"tcp-established", "nf_conntrack_tcp_timeout_established", 5 * 24 * time.Hour, func(t *Timeouts) *time.Duration { return &t.TCPEstablished }},
	{"tcp-opening", "nf_conntrack_tcp_timeout_syn_sent", 2 * time.Minute, func(t *Timeouts) *time.Duration { return &t.TCPOpening }},
	{"tcp-closing", "nf_conntrack_tcp_timeout_time_wait", 2 * time.Minute, func(t *Timeouts) *time.Duration { return &t.TCPClosing }},
	{"udp", "nf_conntrack_udp_timeout_stream", 2 * time.Minute, func(t *Timeouts) *time.Duration { return &t.UDP }},
	{"icmp", "nf_conntrack_icmp_timeout", 30 * time.Second, func(t *Timeouts) *time.Duration { return &t.ICMP }},
	{"other", "nf_conntrack_generic_timeout", 10 * time.Minute, func(t *Timeouts) *time.Duration { return &t.Other }},
}

// DefaultTimeouts are conntrack's own defaults (TimeoutKeys).
var DefaultTimeouts = func() Timeouts {
	var t Timeouts
	for _, k := range TimeoutKeys {
		*k.Of(&t) = k.Conntrack
	}
	return t
}()

// ConntrackSysctlDir holds the conntrack sysctls of the reading process's network namespace,
// while the nf_conntrack module is loaded.
const ConntrackSysctlDir = "/proc/sys/net/netfilter"

// Where a timeout in force comes from (ResolveTimeouts), in the order they win.
const (
	FromFlag      = "--nat-timeouts"
	FromNode      = "the node's conntrack sysctl"
	FromConntrack = "conntrack's default"
)

// ResolveTimeouts returns the timeouts in force, each of them: as set (nonzero) in set, the
// --nat-timeouts; else the node's own conntrack sysctl of it under dir (ConntrackSysctlDir:
// those of the namespace the agent runs in, the node's), where the nf_conntrack module is
// loaded and the value is a positive number of seconds; else conntrack's default. from says,
// by key name, where each came from.
func ResolveTimeouts(set Timeouts, dir string) (t Timeouts, from map[string]string) {
	t, from = set, make(map[string]string, len(TimeoutKeys))
	for _, k := range TimeoutKeys {
		v := k.Of(&t)
		if *v > 0 {
			from[k.Name] = FromFlag
		} else if *v = readSeconds(filepath.Join(dir, k.Sysctl)); *v > 0 {
			from[k.Name] = FromNode
		} else {
			*v, from[k.Name] = k.Conntrack, FromConntrack
		}
	}
	return t, from
}

// readSeconds reads a sysctl of seconds; 0 when it is missing or no positive number.
func readSeconds(path string) time.Duration {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	if err != nil || n <= 0 || n > int64(1<<62/time.Second) {
		return 0
	}
	return time.Duration(n) * time.Second
}
