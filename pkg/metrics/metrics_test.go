package metrics

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ip-masq-agent/ip-masq-agent/internal/markdown"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/backends"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath/datapathtest"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// natInfo is how the fakes of a BPF-like datapath say they are installed.
var natInfo = datapath.Info{Backend: "bpf", AttachMode: "tcx"}

type fakeStats struct{ s agent.Stats }

func (f fakeStats) Stats() agent.Stats { return f.s }

func rc(fam policy.Family, number int, prefix string, action policy.Action, origin policy.Origin, entry int, packets, bytes uint64) datapath.RuleCounter {
	return datapath.RuleCounter{Family: fam, Rule: number, Prefix: netip.MustParsePrefix(prefix), Action: action,
		Origin: origin, Entry: entry, Packets: packets, Bytes: bytes}
}

// scrape serves the registry over HTTP, as Prometheus sees it, and parses the answer.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	srv := httptest.NewServer(Handler(reg, nil))
	defer srv.Close()
	resp, err := http.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse scrape: %v", err)
	}
	return fams
}

func newRegistry(t *testing.T, opts Options) *prometheus.Registry {
	t.Helper()
	reg, err := NewRegistry(opts)
	if err != nil {
		t.Fatal(err)
	}
	return reg
}

func TestRuleMetrics(t *testing.T) {
	b := &datapathtest.Backend{RuleCounters: []datapath.RuleCounter{
		rc(policy.IPv4, 1, "169.254.0.0/16", policy.Return, policy.OriginLinkLocal, -1, 1, 84),
		// The same CIDR and action from another origin is another series.
		rc(policy.IPv4, 2, "169.254.0.0/16", policy.Return, policy.OriginNonMasqueradeCIDRs, 0, 0, 0),
		rc(policy.IPv4, 3, "10.0.0.0/8", policy.Return, policy.OriginNonMasqueradeCIDRs, 1, 7, 700),
		// A duplicate of rule 3: same labels, so only the first is reported.
		rc(policy.IPv4, 4, "10.0.0.0/8", policy.Return, policy.OriginNonMasqueradeCIDRs, 2, 99, 9900),
		rc(policy.IPv4, 5, "0.0.0.0/0", policy.Masquerade, policy.OriginOutbound, -1, 3, 180),
		rc(policy.IPv6, 1, "fe80::/10", policy.Return, policy.OriginLinkLocal, -1, 0, 0),
		rc(policy.IPv6, 2, "::/0", policy.Masquerade, policy.OriginOutbound, -1, 5, 400),
		// Not a rule of the policy (only a dump's Reader reports these): left out.
		{Family: policy.IPv4, Prefix: netip.MustParsePrefix("192.0.2.0/24"), Packets: 1},
	}}
	c := NewCollector(Options{Backend: b, Entries: backends.All})
	// The help says what each backend of the registry counts (countsHelp), naming every one.
	for _, b := range backends.All {
		if help := helpOf(RulePackets); !strings.Contains(help, cmp.Or(b.Counts, "every packet")) || !strings.Contains(help, b.Name) {
			t.Errorf("%s's help does not say what %s counts: %s", RulePackets, b.Name, help)
		}
	}
	want := `
# HELP ip_masq_agent_rule_packets_total ` + helpOf(RulePackets) + `
# TYPE ip_masq_agent_rule_packets_total counter
ip_masq_agent_rule_packets_total{action="RETURN",cidr="169.254.0.0/16",family="ipv4",origin="link-local"} 1
ip_masq_agent_rule_packets_total{action="RETURN",cidr="169.254.0.0/16",family="ipv4",origin="nonMasqueradeCIDRs"} 0
ip_masq_agent_rule_packets_total{action="RETURN",cidr="10.0.0.0/8",family="ipv4",origin="nonMasqueradeCIDRs"} 7
ip_masq_agent_rule_packets_total{action="MASQUERADE",cidr="0.0.0.0/0",family="ipv4",origin="outbound"} 3
ip_masq_agent_rule_packets_total{action="RETURN",cidr="fe80::/10",family="ipv6",origin="link-local"} 0
ip_masq_agent_rule_packets_total{action="MASQUERADE",cidr="::/0",family="ipv6",origin="outbound"} 5
# HELP ip_masq_agent_rule_bytes_total Bytes (IP packet lengths) of the packets counted in ip_masq_agent_rule_packets_total.
# TYPE ip_masq_agent_rule_bytes_total counter
ip_masq_agent_rule_bytes_total{action="RETURN",cidr="169.254.0.0/16",family="ipv4",origin="link-local"} 84
ip_masq_agent_rule_bytes_total{action="RETURN",cidr="169.254.0.0/16",family="ipv4",origin="nonMasqueradeCIDRs"} 0
ip_masq_agent_rule_bytes_total{action="RETURN",cidr="10.0.0.0/8",family="ipv4",origin="nonMasqueradeCIDRs"} 700
ip_masq_agent_rule_bytes_total{action="MASQUERADE",cidr="0.0.0.0/0",family="ipv4",origin="outbound"} 180
ip_masq_agent_rule_bytes_total{action="RETURN",cidr="fe80::/10",family="ipv6",origin="link-local"} 0
ip_masq_agent_rule_bytes_total{action="MASQUERADE",cidr="::/0",family="ipv6",origin="outbound"} 400
# HELP ip_masq_agent_scrape_errors_total Scrapes whose read of the datapath failed, by source (rules, nat, hooks); the scrape then leaves those metrics out.
# TYPE ip_masq_agent_scrape_errors_total counter
ip_masq_agent_scrape_errors_total{source="rules"} 0
# HELP ip_masq_agent_datapath_info Always 1; the datapath backend and how its programs are attached (none for a backend without programs).
# TYPE ip_masq_agent_datapath_info gauge
ip_masq_agent_datapath_info{attach_mode="none",backend="fake"} 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), RulePackets, RuleBytes, ScrapeErrors, DatapathInfo); err != nil {
		t.Error(err)
	}
	// Every rule counts in its origin's total (the duplicate as the rule it repeats), and the
	// rules are counted by family.
	totals := `
# HELP ip_masq_agent_origin_packets_total ` + helpOf(OriginPackets) + `
# TYPE ip_masq_agent_origin_packets_total counter
ip_masq_agent_origin_packets_total{action="RETURN",family="ipv4",origin="link-local"} 1
ip_masq_agent_origin_packets_total{action="RETURN",family="ipv4",origin="nonMasqueradeCIDRs"} 7
ip_masq_agent_origin_packets_total{action="MASQUERADE",family="ipv4",origin="outbound"} 3
ip_masq_agent_origin_packets_total{action="RETURN",family="ipv6",origin="link-local"} 0
ip_masq_agent_origin_packets_total{action="MASQUERADE",family="ipv6",origin="outbound"} 5
# HELP ip_masq_agent_origin_bytes_total ` + helpOf(OriginBytes) + `
# TYPE ip_masq_agent_origin_bytes_total counter
ip_masq_agent_origin_bytes_total{action="RETURN",family="ipv4",origin="link-local"} 84
ip_masq_agent_origin_bytes_total{action="RETURN",family="ipv4",origin="nonMasqueradeCIDRs"} 700
ip_masq_agent_origin_bytes_total{action="MASQUERADE",family="ipv4",origin="outbound"} 180
ip_masq_agent_origin_bytes_total{action="RETURN",family="ipv6",origin="link-local"} 0
ip_masq_agent_origin_bytes_total{action="MASQUERADE",family="ipv6",origin="outbound"} 400
# HELP ip_masq_agent_rules ` + helpOf(Rules) + `
# TYPE ip_masq_agent_rules gauge
ip_masq_agent_rules{family="ipv4"} 4
ip_masq_agent_rules{family="ipv6"} 2
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(totals), OriginPackets, OriginBytes, Rules); err != nil {
		t.Error(err)
	}
	// Without the optional NAT interface there are no NAT series at all.
	if n := testutil.CollectAndCount(c, NATEntries, NATFillRatio, NATEvictable, NATPortRetries, NATPortFailures, NATPortAttempts,
		Drops, DatapathEvents, NATSwept); n != 0 {
		t.Errorf("%d NAT series from a backend without a NAT table", n)
	}
}

func TestNATMetrics(t *testing.T) {
	b := &datapathtest.NATBackend{Installed: natInfo, Stats: datapath.NATStats{
		Entries: []datapath.NATEntries{
			{Family: policy.IPv4, Protocol: "tcp", State: "established", Entries: 10},
			{Family: policy.IPv4, Protocol: "udp", State: "unreplied", Entries: 4},
			{Family: policy.IPv4, Protocol: "tcp", State: "closing", Entries: 2},
			// A second count of the same family, protocol and state adds up.
			{Family: policy.IPv4, Protocol: "tcp", State: "closing", Entries: 1},
			{Family: policy.IPv6, Protocol: "icmpv6", State: "kept", Entries: 2},
		},
		Tables: []datapath.NATTable{
			{Family: policy.IPv4, Table: "confirmed", Entries: 12, Capacity: 48},
			{Family: policy.IPv4, Table: "unreplied", Entries: 4, Capacity: 32},
			// An empty table has no capacity reported: no ratio.
			{Family: policy.IPv6, Table: "keep", Entries: 0, Capacity: 0},
		},
		EstablishedEvictable:   5,
		PortAllocationRetries:  17,
		PortAllocationFailures: 3,
		PortAttempts:           datapath.Histogram{Bounds: []float64{1, 2, 4}, Counts: []uint64{30, 8, 2}, Sum: 52},
		Drops:                  map[string]uint64{"no_port": 3, "no_addr": 0, "rewrite": 1},
		Events:                 map[string]uint64{"new_masq": 40, "port_retry": 17, "drop_no_port": 3, "drop_no_addr": 0, "drop_rewrite": 1},
		Swept:                  map[string]uint64{"tcp": 40, "udp": 12},
	}}
	c := NewCollector(Options{Backend: b})
	want := `
# HELP ip_masq_agent_nat_entries ` + helpOf(NATEntries) + `
# TYPE ip_masq_agent_nat_entries gauge
ip_masq_agent_nat_entries{family="ipv4",protocol="tcp",state="established"} 10
ip_masq_agent_nat_entries{family="ipv4",protocol="tcp",state="closing"} 3
ip_masq_agent_nat_entries{family="ipv4",protocol="udp",state="unreplied"} 4
ip_masq_agent_nat_entries{family="ipv6",protocol="icmpv6",state="kept"} 2
# HELP ip_masq_agent_nat_fill_ratio ` + helpOf(NATFillRatio) + `
# TYPE ip_masq_agent_nat_fill_ratio gauge
ip_masq_agent_nat_fill_ratio{family="ipv4",table="confirmed"} 0.25
ip_masq_agent_nat_fill_ratio{family="ipv4",table="unreplied"} 0.125
# HELP ip_masq_agent_nat_established_evictions_total ` + helpOf(NATEvictable) + `
# TYPE ip_masq_agent_nat_established_evictions_total counter
ip_masq_agent_nat_established_evictions_total 5
# HELP ip_masq_agent_nat_port_allocation_retries_total Source port claims that found the port taken and tried another.
# TYPE ip_masq_agent_nat_port_allocation_retries_total counter
ip_masq_agent_nat_port_allocation_retries_total 17
# HELP ip_masq_agent_nat_port_allocation_failures_total ` + helpOf(NATPortFailures) + `
# TYPE ip_masq_agent_nat_port_allocation_failures_total counter
ip_masq_agent_nat_port_allocation_failures_total 3
# HELP ip_masq_agent_nat_port_allocation_attempts ` + helpOf(NATPortAttempts) + `
# TYPE ip_masq_agent_nat_port_allocation_attempts histogram
ip_masq_agent_nat_port_allocation_attempts_bucket{le="1"} 30
ip_masq_agent_nat_port_allocation_attempts_bucket{le="2"} 38
ip_masq_agent_nat_port_allocation_attempts_bucket{le="4"} 40
ip_masq_agent_nat_port_allocation_attempts_bucket{le="+Inf"} 40
ip_masq_agent_nat_port_allocation_attempts_sum 52
ip_masq_agent_nat_port_allocation_attempts_count 40
# HELP ip_masq_agent_drops_total Packets the BPF datapath dropped, by reason: no_port, no_addr (the uplink has no address of the family), rewrite (a rewrite failed), untranslatable (a pod's packet the NAT cannot translate, to a masqueraded destination).
# TYPE ip_masq_agent_drops_total counter
ip_masq_agent_drops_total{reason="no_addr"} 0
ip_masq_agent_drops_total{reason="no_port"} 3
ip_masq_agent_drops_total{reason="rewrite"} 1
# HELP ip_masq_agent_nat_swept_entries_total NAT table entries the periodic sweep removed as idle.
# TYPE ip_masq_agent_nat_swept_entries_total counter
ip_masq_agent_nat_swept_entries_total{protocol="tcp"} 40
ip_masq_agent_nat_swept_entries_total{protocol="udp"} 12
# HELP ip_masq_agent_datapath_info Always 1; the datapath backend and how its programs are attached (none for a backend without programs).
# TYPE ip_masq_agent_datapath_info gauge
ip_masq_agent_datapath_info{attach_mode="tcx",backend="bpf"} 1
# HELP ip_masq_agent_scrape_errors_total Scrapes whose read of the datapath failed, by source (rules, nat, hooks); the scrape then leaves those metrics out.
# TYPE ip_masq_agent_scrape_errors_total counter
ip_masq_agent_scrape_errors_total{source="nat"} 0
ip_masq_agent_scrape_errors_total{source="rules"} 0
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), NATEntries, NATFillRatio, NATEvictable, NATPortRetries,
		NATPortFailures, NATPortAttempts, Drops, NATSwept, DatapathInfo, ScrapeErrors); err != nil {
		t.Error(err)
	}
	// Every event the backend counts is a series of its own, zero or not.
	events := `
# HELP ip_masq_agent_datapath_events_total ` + helpOf(DatapathEvents) + `
# TYPE ip_masq_agent_datapath_events_total counter
ip_masq_agent_datapath_events_total{event="drop_no_addr"} 0
ip_masq_agent_datapath_events_total{event="drop_no_port"} 3
ip_masq_agent_datapath_events_total{event="drop_rewrite"} 1
ip_masq_agent_datapath_events_total{event="new_masq"} 40
ip_masq_agent_datapath_events_total{event="port_retry"} 17
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(events), DatapathEvents); err != nil {
		t.Error(err)
	}
}

// reachable is a configuration source that can lose its way (config.Reachable); err is why.
type reachable struct {
	config.Source
	err error
}

func (r reachable) Unreachable() error { return r.err }

// deletable is an API source whose object is deleted or not (config.Deletable).
type deletable struct {
	reachable
	deleted bool
}

func (d deletable) Deleted() bool { return d.deleted }

// beating is a node status publisher with a heartbeat.
type beating struct {
	writes
	last  time.Time
	every time.Duration
}

func (b beating) Heartbeat() (time.Time, time.Duration) { return b.last, b.every }

// writes is a node status publisher's count of writes.
type writes struct{ ok, failed uint64 }

func (w writes) Writes() (uint64, uint64) { return w.ok, w.failed }

// The API server's reach and the status writes are exported for the sources and publishers
// that have them, and only then.
func TestSourceAndStatusMetrics(t *testing.T) {
	c := NewCollector(Options{Backend: &datapathtest.Backend{}, Source: reachable{err: errors.New("connection refused")},
		Status: writes{ok: 3, failed: 1}})
	want := `
# HELP ip_masq_agent_config_source_reachable ` + helpOf(SourceReachable) + `
# TYPE ip_masq_agent_config_source_reachable gauge
ip_masq_agent_config_source_reachable 0
# HELP ip_masq_agent_node_status_writes_total ` + helpOf(StatusWrites) + `
# TYPE ip_masq_agent_node_status_writes_total counter
ip_masq_agent_node_status_writes_total{result="error"} 1
ip_masq_agent_node_status_writes_total{result="success"} 3
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), SourceReachable, StatusWrites); err != nil {
		t.Error(err)
	}
	c = NewCollector(Options{Backend: &datapathtest.Backend{}})
	if n := testutil.CollectAndCount(c, SourceReachable, StatusWrites, SourceDeleted, StatusLastWrite, StatusHeartbeat); n != 0 {
		t.Errorf("%d series without an API source or a publisher", n)
	}
	// A deleted object, and the heartbeat of a publisher that has one.
	c = NewCollector(Options{Backend: &datapathtest.Backend{}, Source: deletable{deleted: true},
		Status: beating{last: time.Unix(1_700_000_000, 500_000_000), every: 5 * time.Minute}})
	want = `
# HELP ip_masq_agent_config_source_deleted ` + helpOf(SourceDeleted) + `
# TYPE ip_masq_agent_config_source_deleted gauge
ip_masq_agent_config_source_deleted 1
# HELP ip_masq_agent_node_status_last_write_timestamp_seconds ` + helpOf(StatusLastWrite) + `
# TYPE ip_masq_agent_node_status_last_write_timestamp_seconds gauge
ip_masq_agent_node_status_last_write_timestamp_seconds 1.7000000005e+09
# HELP ip_masq_agent_node_status_heartbeat_interval_seconds ` + helpOf(StatusHeartbeat) + `
# TYPE ip_masq_agent_node_status_heartbeat_interval_seconds gauge
ip_masq_agent_node_status_heartbeat_interval_seconds 300
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), SourceDeleted, StatusLastWrite, StatusHeartbeat); err != nil {
		t.Error(err)
	}
}

func helpOf(name string) string {
	for _, d := range Definitions(backends.All) {
		if d.Name == name {
			return d.Help
		}
	}
	return ""
}

func TestAgentMetrics(t *testing.T) {
	var s agent.Stats
	s.Reloads, s.ConfigErrors, s.ReloadApplyErrors, s.ApplyErrors, s.AddressErrors = 5, 2, 1, 3, 4
	s.MissingAddresses = []netip.Addr{netip.MustParseAddr("10.0.0.11"), netip.MustParseAddr("2001:db8::11")}
	s.LastReload = time.Unix(1700000000, 500_000_000)
	s.ConfigSHA256 = strings.Repeat("ab", 32)
	// One apply in each bucket from le=0.0025 to le=1, 1.5 s in all (exact in binary).
	obs := NewObserver()
	for _, ns := range []time.Duration{1953125, 3906250, 7812500, 15625000, 31250000, 62500000, 125000000, 375000000, 876953125} {
		obs.ObserveApply(ns, nil)
	}
	c := NewCollector(Options{Backend: &datapathtest.Backend{}, Agent: fakeStats{s}, Observer: obs})
	want := `
# HELP ip_masq_agent_config_reloads_total Reads of the config file by result: success (its policy is in the datapath), invalid (parse or validation failed; the last good configuration stays), address_missing (it names a masquerade address the node does not have; the last good configuration stays), apply_error.
# TYPE ip_masq_agent_config_reloads_total counter
ip_masq_agent_config_reloads_total{result="success"} 5
ip_masq_agent_config_reloads_total{result="invalid"} 2
ip_masq_agent_config_reloads_total{result="apply_error"} 1
ip_masq_agent_config_reloads_total{result="address_missing"} 4
# HELP ip_masq_agent_masquerade_address_missing 1 for each masquerade address that the configuration in force, or the last one read, names and no uplink of the node has; no series while all are there.
# TYPE ip_masq_agent_masquerade_address_missing gauge
ip_masq_agent_masquerade_address_missing{address="10.0.0.11"} 1
ip_masq_agent_masquerade_address_missing{address="2001:db8::11"} 1
# HELP ip_masq_agent_config_last_reload_success_timestamp_seconds Unix time of the last successful reload; 0 before the first.
# TYPE ip_masq_agent_config_last_reload_success_timestamp_seconds gauge
ip_masq_agent_config_last_reload_success_timestamp_seconds 1.7000000005e+09
# HELP ip_masq_agent_config_info Always 1; sha256 is the hash of the canonical form of the configuration in force.
# TYPE ip_masq_agent_config_info gauge
ip_masq_agent_config_info{sha256="` + s.ConfigSHA256 + `"} 1
# HELP ip_masq_agent_datapath_sync_errors_total Applies of the policy that failed (each is retried).
# TYPE ip_masq_agent_datapath_sync_errors_total counter
ip_masq_agent_datapath_sync_errors_total 3
# HELP ip_masq_agent_datapath_sync_duration_seconds Time to apply the policy to the datapath, failed applies included.
# TYPE ip_masq_agent_datapath_sync_duration_seconds histogram
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.001"} 0
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.0025"} 1
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.005"} 2
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.01"} 3
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.025"} 4
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.05"} 5
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.1"} 6
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.25"} 7
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="0.5"} 8
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="1"} 9
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="2.5"} 9
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="5"} 9
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="10"} 9
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="30"} 9
ip_masq_agent_datapath_sync_duration_seconds_bucket{le="+Inf"} 9
ip_masq_agent_datapath_sync_duration_seconds_sum 1.5
ip_masq_agent_datapath_sync_duration_seconds_count 9
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), ConfigReloads, AddressMissing, ConfigLastReload, ConfigInfo, DatapathSyncErrors, DatapathSyncDuration); err != nil {
		t.Error(err)
	}

	// Health: ready, no rejection, no drift that persists, no fallback.
	health := `
# HELP ip_masq_agent_config_rejected ` + helpOf(ConfigRejected) + `
# TYPE ip_masq_agent_config_rejected gauge
ip_masq_agent_config_rejected 0
# HELP ip_masq_agent_ready ` + helpOf(Ready) + `
# TYPE ip_masq_agent_ready gauge
ip_masq_agent_ready 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(health), ConfigRejected, Ready, DriftPersisting, DatapathFallback); err != nil {
		t.Error(err)
	}
	// The same, unhealthy: a rejected configuration, drift no apply repairs beside drift an
	// apply did not, and a fallback.
	s.Rejected, s.NotReady = "config: masqOutBound: ...", "the policy is not enforced everywhere: bypassed"
	s.Unenforced, s.Persisting = []string{datapath.DriftBypassed}, []string{datapath.DriftTrie, datapath.DriftBypassed}
	c = NewCollector(Options{Backend: &datapathtest.Backend{}, Agent: fakeStats{s}, Fallback: []string{"bpf", "nftables"}})
	health = `
# HELP ip_masq_agent_config_rejected ` + helpOf(ConfigRejected) + `
# TYPE ip_masq_agent_config_rejected gauge
ip_masq_agent_config_rejected 1
# HELP ip_masq_agent_ready ` + helpOf(Ready) + `
# TYPE ip_masq_agent_ready gauge
ip_masq_agent_ready 0
# HELP ip_masq_agent_drift_persisting ` + helpOf(DriftPersisting) + `
# TYPE ip_masq_agent_drift_persisting gauge
ip_masq_agent_drift_persisting{what="bypassed"} 1
ip_masq_agent_drift_persisting{what="trie"} 1
# HELP ip_masq_agent_datapath_fallback ` + helpOf(DatapathFallback) + `
# TYPE ip_masq_agent_datapath_fallback gauge
ip_masq_agent_datapath_fallback{backend="bpf"} 1
ip_masq_agent_datapath_fallback{backend="nftables"} 1
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(health), ConfigRejected, Ready, DriftPersisting, DatapathFallback); err != nil {
		t.Error(err)
	}

	// Before the first good reload: no config_info, a zero timestamp.
	c = NewCollector(Options{Backend: &datapathtest.Backend{}, Agent: fakeStats{}})
	if n := testutil.CollectAndCount(c, ConfigInfo); n != 0 {
		t.Errorf("%d config_info series before any configuration", n)
	}
	want = `
# HELP ip_masq_agent_config_last_reload_success_timestamp_seconds Unix time of the last successful reload; 0 before the first.
# TYPE ip_masq_agent_config_last_reload_success_timestamp_seconds gauge
ip_masq_agent_config_last_reload_success_timestamp_seconds 0
`
	if err := testutil.CollectAndCompare(c, strings.NewReader(want), ConfigLastReload); err != nil {
		t.Error(err)
	}
}

func TestBuildInfo(t *testing.T) {
	fams := scrape(t, newRegistry(t, Options{Backend: &datapathtest.Backend{}}))
	bi := fams[BuildInfo]
	if bi == nil || len(bi.Metric) != 1 || bi.Metric[0].GetGauge().GetValue() != 1 {
		t.Fatalf("build_info %v", bi)
	}
	labels := map[string]string{}
	for _, l := range bi.Metric[0].Label {
		labels[l.GetName()] = l.GetValue()
	}
	if labels["version"] != version.Version || labels["revision"] != version.Revision() || !strings.HasPrefix(labels["goversion"], "go") {
		t.Errorf("build_info labels %v", labels)
	}
	// The standard runtime and process metrics are there too.
	for _, name := range []string{"go_goroutines", "process_resident_memory_bytes"} {
		if fams[name] == nil {
			t.Errorf("no %s", name)
		}
	}
}

// A failed datapath read costs its own metrics only, and is counted: the scrape still answers.
func TestScrapeErrors(t *testing.T) {
	b := &datapathtest.NATBackend{Backend: datapathtest.Backend{CountersErr: errors.New("iptables-save: exit status 1")},
		Installed: natInfo, StatsErr: errors.New("map gone")}
	reg := newRegistry(t, Options{Backend: b, Agent: fakeStats{agent.Stats{Reloads: 1}}, Observer: NewObserver()})
	for i := 1; i <= 2; i++ {
		fams := scrape(t, reg)
		if fams[RulePackets] != nil || fams[NATEntries] != nil || fams[NATPortRetries] != nil {
			t.Errorf("scrape %d: metrics of failed reads are served", i)
		}
		for _, name := range []string{BuildInfo, DatapathInfo, ConfigReloads, DatapathSyncDuration} {
			if fams[name] == nil {
				t.Errorf("scrape %d: %s missing", i, name)
			}
		}
		errs := map[string]float64{}
		for _, m := range fams[ScrapeErrors].GetMetric() {
			errs[m.Label[0].GetValue()] = m.GetCounter().GetValue()
		}
		if errs[SourceRules] != float64(i) || errs[SourceNAT] != float64(i) {
			t.Errorf("scrape %d: scrape errors %v, want %d of each", i, errs, i)
		}
	}
}

// A read that hangs is cut off by the read timeout, well within a scrape.
func TestScrapeReadTimeout(t *testing.T) {
	b := &datapathtest.Backend{BlockCounters: true}
	reg := newRegistry(t, Options{Backend: b, ReadTimeout: 50 * time.Millisecond})
	start := time.Now()
	fams := scrape(t, reg)
	if took := time.Since(start); took > time.Second { // DefaultReadTimeout is 5 s
		t.Errorf("scrape took %v", took)
	}
	if fams[ScrapeErrors].GetMetric()[0].GetCounter().GetValue() != 1 {
		t.Errorf("timed-out read not counted: %v", fams[ScrapeErrors])
	}
}

// Scrapes read at scrape time: a counter that moves shows the new value on the next scrape,
// with no polling in between; concurrent scrapes are fine.
func TestScrapeTimeReads(t *testing.T) {
	b := &datapathtest.Backend{RuleCounters: []datapath.RuleCounter{rc(policy.IPv4, 1, "10.0.0.0/8", policy.Return, policy.OriginNonMasqueradeCIDRs, 0, 1, 60)}}
	reg := newRegistry(t, Options{Backend: b})
	time.Sleep(20 * time.Millisecond)
	if n := b.Reads(); n != 0 {
		t.Fatalf("%d reads before any scrape", n)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := reg.Gather(); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	more := slices.Clone(b.RuleCounters)
	more[0].Packets = 42
	b.SetRuleCounters(more)
	fams := scrape(t, reg)
	if v := fams[RulePackets].GetMetric()[0].GetCounter().GetValue(); v != 42 {
		t.Errorf("packets %v, want 42", v)
	}
	if n := b.Reads(); n != 5 {
		t.Errorf("%d reads for 5 scrapes", n)
	}
}

// Every metric follows Prometheus' naming conventions, and Names is exactly what is exported.
func TestNamesAndLint(t *testing.T) {
	s := agent.Stats{ConfigSHA256: strings.Repeat("0", 64), Heals: map[string]uint64{datapath.DriftTrie: 1},
		MissingAddresses: []netip.Addr{netip.MustParseAddr("10.0.0.11")}, Persisting: []string{datapath.DriftTrie}}
	b := &datapathtest.HookBackend{NATBackend: datapathtest.NATBackend{Installed: natInfo,
		Backend: datapathtest.Backend{RuleCounters: []datapath.RuleCounter{rc(policy.IPv4, 1, "10.0.0.0/8", policy.Return, policy.OriginNonMasqueradeCIDRs, 0, 1, 60)}},
		Stats: datapath.NATStats{Entries: []datapath.NATEntries{{Family: policy.IPv4, Protocol: "tcp", State: "established", Entries: 1}},
			Tables:       []datapath.NATTable{{Family: policy.IPv4, Table: "confirmed", Entries: 1, Capacity: 4}},
			PortAttempts: datapath.Histogram{Bounds: []float64{1, 2}, Counts: []uint64{1, 0}, Sum: 1},
			Events:       map[string]uint64{"drop_no_port": 0}, Drops: map[string]uint64{"no_port": 0}, Swept: map[string]uint64{"tcp": 0}},
	}, Hook: []datapath.Hook{{Device: "eth0", Ifindex: 2, Direction: "egress"}},
		Uplink: []datapath.Uplink{{Device: "eth0", Ifindex: 2, Via: "default route", Covered: true}}}
	c := NewCollector(Options{Backend: b, Agent: fakeStats{s}, Observer: NewObserver(), Fallback: []string{"bpf"},
		Source: deletable{}, Status: beating{}})
	problems, err := testutil.CollectAndLint(c)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
	fams := scrape(t, newRegistry(t, Options{Backend: b, Agent: fakeStats{s}, Observer: NewObserver(), Fallback: []string{"bpf"},
		Source: deletable{}, Status: beating{}}))
	var got []string
	for name := range fams {
		if strings.HasPrefix(name, Namespace+"_") {
			got = append(got, name)
		}
	}
	want := slices.Clone(Names())
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("exported %q\nNames    %q", got, want)
	}
	for _, d := range Definitions(backends.All) {
		for _, m := range fams[d.Name].GetMetric() {
			var labels []string
			for _, l := range m.Label {
				labels = append(labels, l.GetName())
			}
			if want := slices.Sorted(slices.Values(d.Labels)); !slices.Equal(labels, want) {
				t.Errorf("%s has labels %q, its definition %q", d.Name, labels, d.Labels)
			}
		}
		if want := strings.ToLower(d.Type); strings.ToLower(fams[d.Name].GetType().String()) != want {
			t.Errorf("%s is a %s, its definition says %s", d.Name, fams[d.Name].GetType(), d.Type)
		}
	}
}

// The Observer counts every apply into the buckets of its duration, cumulatively, as a
// Prometheus histogram does; a duration beyond the last bucket counts only in the total.
func TestObserverBuckets(t *testing.T) {
	obs := NewObserver()
	for _, d := range []time.Duration{time.Millisecond, 3 * time.Millisecond, time.Second, time.Minute} {
		obs.ObserveApply(d, nil)
	}
	var m dto.Metric
	if err := obs.syncDuration.Write(&m); err != nil {
		t.Fatal(err)
	}
	h := m.GetHistogram()
	if len(h.GetBucket()) != len(syncBuckets) {
		t.Fatalf("%d buckets, want %d", len(h.GetBucket()), len(syncBuckets))
	}
	for i, b := range h.GetBucket() {
		var want uint64
		for _, d := range []float64{0.001, 0.003, 1} {
			if d <= syncBuckets[i] {
				want++
			}
		}
		if b.GetUpperBound() != syncBuckets[i] || b.GetCumulativeCount() != want {
			t.Errorf("bucket le=%g holds %d, want le=%g holding %d", b.GetUpperBound(), b.GetCumulativeCount(), syncBuckets[i], want)
		}
	}
	if h.GetSampleCount() != 4 || h.GetSampleSum() != (time.Minute+time.Second+4*time.Millisecond).Seconds() {
		t.Errorf("count %d sum %v", h.GetSampleCount(), h.GetSampleSum())
	}
}

// docs/reference.md's Metrics section lists every metric with exactly its labels, and nothing
// else.
func TestReferenceListsEveryMetric(t *testing.T) {
	const page = "docs/reference.md"
	doc, err := markdown.Read(page)
	if err != nil {
		t.Fatal(err)
	}
	section, ok := markdown.Section(doc, "## Metrics")
	if !ok {
		t.Fatalf("%s has no Metrics section", page)
	}
	rows := map[string][]string{} // metric -> labels
	for _, cells := range markdown.Rows(section) {
		if len(cells) < 4 || !strings.HasPrefix(cells[0], "`"+Namespace) {
			continue
		}
		name := strings.Trim(cells[0], "`")
		var labels []string
		for _, l := range strings.Split(cells[2], ",") {
			if l = strings.Trim(strings.TrimSpace(l), "`"); l != "" {
				labels = append(labels, l)
			}
		}
		if _, dup := rows[name]; dup {
			t.Errorf("%s lists %s twice", page, name)
		}
		rows[name] = labels
		if typ := cells[1]; !slices.ContainsFunc(Definitions(backends.All), func(d Definition) bool { return d.Name == name && d.Type == typ }) {
			t.Errorf("%s: %s is a %q, which no definition says", page, name, typ)
		}
	}
	for _, d := range Definitions(backends.All) {
		labels, ok := rows[d.Name]
		if !ok {
			t.Errorf("%s does not list %s: add a row to its Metrics table", page, d.Name)
			continue
		}
		if !slices.Equal(labels, d.Labels) {
			t.Errorf("%s lists %s with labels %q, it has %q", page, d.Name, labels, d.Labels)
		}
		delete(rows, d.Name)
	}
	for name := range rows {
		t.Errorf("%s lists %s, which the agent does not export", page, name)
	}
}

// Heals are exported by kind: every kind the backend can heal from the start (zero), and every
// kind the agent counted.
func TestHeals(t *testing.T) {
	read := func(b datapath.Backend, heals map[string]uint64) map[string]float64 {
		t.Helper()
		fams := scrape(t, newRegistry(t, Options{Backend: b, Agent: fakeStats{agent.Stats{Heals: heals}}}))
		out := map[string]float64{}
		for _, m := range fams[Heals].GetMetric() {
			out[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
		}
		return out
	}
	got := read(&datapathtest.DriftBackend{}, map[string]uint64{datapath.DriftTrie: 2, datapath.DriftChain: 1})
	want := map[string]float64{"program": 0, "pin": 0, "trie": 2, "chain": 1}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("heals %v, want %v", got, want)
	}
	if got := read(&datapathtest.Backend{}, nil); len(got) != 0 {
		t.Errorf("a backend without drift checks, nothing healed: %v", got)
	}
}

// One uplink_info series per device pod traffic can leave by, covered or not.
func TestUplinkMetrics(t *testing.T) {
	b := &datapathtest.HookBackend{NATBackend: datapathtest.NATBackend{Installed: natInfo}, Uplink: []datapath.Uplink{
		{Device: "eth0", Ifindex: 2, Via: "default route", Covered: true},
		{Device: "eth1", Ifindex: 3, Via: "route 198.18.0.0/15 table 100", Covered: true},
		{Device: "wg0", Ifindex: 9, Via: "route 100.64.0.0/10", Note: "no Ethernet header"},
	}}
	var got []string
	for _, m := range scrape(t, newRegistry(t, Options{Backend: b}))[UplinkInfo].GetMetric() {
		var ls []string
		for _, l := range m.Label {
			ls = append(ls, l.GetName()+"="+l.GetValue())
		}
		got = append(got, fmt.Sprintf("%s %v", strings.Join(ls, ","), m.GetGauge().GetValue()))
	}
	want := []string{
		"covered=true,device=eth0,via=default route 1",
		"covered=true,device=eth1,via=route 198.18.0.0/15 table 100 1",
		"covered=false,device=wg0,via=route 100.64.0.0/10 1",
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("uplink_info %q\nwant %q", got, want)
	}
}

// The hook metrics: neighbours ahead and behind, the bypass state and its count, per uplink and
// direction; a failed read leaves them out and counts a hooks scrape error.
func TestHookMetrics(t *testing.T) {
	b := &datapathtest.HookBackend{NATBackend: datapathtest.NATBackend{Installed: natInfo}, Hook: []datapath.Hook{
		{Device: "eth0", Ifindex: 2, Direction: "egress", Behind: []string{`tcx program 9 "mon"`}},
		{Device: "eth0", Ifindex: 2, Direction: "ingress", Ahead: []string{`tcx program 7 "cni"`, `tc program 8 "x" priority 1`},
			Bypassed: true, Bypasses: 3},
	}}
	fams := scrape(t, newRegistry(t, Options{Backend: b}))
	got := map[string]float64{}
	for _, name := range []string{HookNeighbours, HookBypassed, HookBypasses} {
		for _, m := range fams[name].GetMetric() {
			var ls []string
			for _, l := range m.Label {
				ls = append(ls, l.GetValue())
			}
			got[name+"{"+strings.Join(ls, ",")+"}"] = m.GetGauge().GetValue() + m.GetCounter().GetValue()
		}
	}
	want := map[string]float64{
		HookNeighbours + "{eth0,egress,ahead}":   0,
		HookNeighbours + "{eth0,egress,behind}":  1,
		HookNeighbours + "{eth0,ingress,ahead}":  2,
		HookNeighbours + "{eth0,ingress,behind}": 0,
		HookBypassed + "{eth0,egress}":           0,
		HookBypassed + "{eth0,ingress}":          1,
		HookBypasses + "{eth0,egress}":           0,
		HookBypasses + "{eth0,ingress}":          3,
	}
	if !maps.Equal(got, want) {
		t.Errorf("hook metrics %v\nwant %v", got, want)
	}

	b.HooksErr = errors.New("netlink: no buffer space")
	fams = scrape(t, newRegistry(t, Options{Backend: b}))
	if _, ok := fams[HookBypassed]; ok {
		t.Errorf("hook metrics reported although their read failed")
	}
	found := false
	for _, m := range fams[ScrapeErrors].GetMetric() {
		if m.Label[0].GetValue() == SourceHooks {
			found = true
			if v := m.GetCounter().GetValue(); v != 1 {
				t.Errorf("hooks scrape errors %v, want 1", v)
			}
		}
	}
	if !found {
		t.Errorf("no hooks scrape errors series")
	}
}
