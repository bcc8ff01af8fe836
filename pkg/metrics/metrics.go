// Package metrics exports the agent's Prometheus metrics: the datapath's per-rule hit counters
// and NAT table, the reload loop's outcomes, and what runs. A Collector reads them when
// Prometheus scrapes (no polling loop), from the backend and from the agent's Stats; an
// Observer records the agent's applies as they happen.
//
// Every metric name starts with Namespace. Definitions lists them all; docs/reference.md's Metrics
// section documents each, and a test keeps the two in step.
package metrics

import (
	"cmp"
	"context"
	"log/slog"
	"maps"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/policy"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/version"
)

// Namespace is the common prefix of the agent's metric names.
const Namespace = "ip_masq_agent"

// DefaultReadTimeout bounds the datapath reads of one scrape: well under Prometheus' default
// scrape timeout of 10 s, so that a stuck read costs its metrics, not the whole scrape.
const DefaultReadTimeout = 5 * time.Second

// Metric names.
const (
	RulePackets          = Namespace + "_rule_packets_total"
	RuleBytes            = Namespace + "_rule_bytes_total"
	OriginPackets        = Namespace + "_origin_packets_total"
	OriginBytes          = Namespace + "_origin_bytes_total"
	Rules                = Namespace + "_rules"
	NATEntries           = Namespace + "_nat_entries"
	NATFillRatio         = Namespace + "_nat_fill_ratio"
	NATEvictable         = Namespace + "_nat_established_evictions_total"
	NATPortRetries       = Namespace + "_nat_port_allocation_retries_total"
	NATPortFailures      = Namespace + "_nat_port_allocation_failures_total"
	NATPortAttempts      = Namespace + "_nat_port_allocation_attempts"
	Drops                = Namespace + "_drops_total"
	DatapathEvents       = Namespace + "_datapath_events_total"
	NATSwept             = Namespace + "_nat_swept_entries_total"
	ConfigReloads        = Namespace + "_config_reloads_total"
	ConfigLastReload     = Namespace + "_config_last_reload_success_timestamp_seconds"
	ConfigInfo           = Namespace + "_config_info"
	ConfigRejected       = Namespace + "_config_rejected"
	Ready                = Namespace + "_ready"
	DriftPersisting      = Namespace + "_drift_persisting"
	DatapathFallback     = Namespace + "_datapath_fallback"
	SourceReachable      = Namespace + "_config_source_reachable"
	StatusWrites         = Namespace + "_node_status_writes_total"
	SourceDeleted        = Namespace + "_config_source_deleted"
	StatusLastWrite      = Namespace + "_node_status_last_write_timestamp_seconds"
	StatusHeartbeat      = Namespace + "_node_status_heartbeat_interval_seconds"
	AddressMissing       = Namespace + "_masquerade_address_missing"
	DatapathSyncDuration = Namespace + "_datapath_sync_duration_seconds"
	SourcePodsApply      = Namespace + "_source_pods_apply_seconds"
	DatapathSyncErrors   = Namespace + "_datapath_sync_errors_total"
	DatapathInfo         = Namespace + "_datapath_info"
	DatapathRefused      = Namespace + "_datapath_refused"
	BuildInfo            = Namespace + "_build_info"
	ScrapeErrors         = Namespace + "_scrape_errors_total"
	Heals                = Namespace + "_heals_total"
	HookNeighbours       = Namespace + "_hook_neighbours"
	HookBypassed         = Namespace + "_hook_bypassed"
	HookBypasses         = Namespace + "_hook_bypasses_total"
	UplinkInfo           = Namespace + "_uplink_info"
)

// Label values of ConfigReloads' result.
const (
	ReloadSuccess    = "success"
	ReloadInvalid    = "invalid"
	ReloadApplyError = "apply_error"
	// ReloadAddressMissing: the configuration names a masquerade address the node lacks.
	ReloadAddressMissing = "address_missing"
)

// Label values of StatusWrites' result.
const (
	WriteSuccess = "success"
	WriteError   = "error"
)

// Label values of ScrapeErrors' source: which datapath read failed.
const (
	SourceRules = "rules"
	SourceNAT   = "nat"
	SourceHooks = "hooks"
)

// Definition describes one metric family.
type Definition struct {
	Name string
	// Type is "counter", "gauge" or "histogram".
	Type   string
	Labels []string
	Help   string
}

var (
	ruleLabels   = []string{"family", "action", "cidr", "origin"}
	originLabels = []string{"family", "action", "origin"}
)

// hookLabels are the labels of the hook metrics: the uplink and the direction, then extra.
func hookLabels(extra ...string) []string { return append([]string{"device", "direction"}, extra...) }

// Definitions returns every metric the agent exports, besides the go_* and process_* metrics
// of client_golang's standard collectors. entries are the backends (backends.All), whose
// Counts and DriftKinds the help of RulePackets and Heals quotes.
func Definitions(entries []datapath.Entry) []Definition {
	return []Definition{
		{RulePackets, "counter", ruleLabels, "Packets that matched the rule, by backend: " + countsHelp(entries) + "."},
		{RuleBytes, "counter", ruleLabels, "Bytes (IP packet lengths) of the packets counted in " + RulePackets + "."},
		{OriginPackets, "counter", originLabels, "Packets that matched the rules of each origin, every rule counted (" + RulePackets + " has series only for the busiest rules of a long policy); a removed rule's packets stay in its origin's total."},
		{OriginBytes, "counter", originLabels, "Bytes of the packets counted in " + OriginPackets + "."},
		{Rules, "gauge", []string{"family"}, "Rules of the policy in force, each counted in " + OriginPackets + "; those beyond --rule-metrics-limit have no " + RulePackets + " series."},
		{NATEntries, "gauge", []string{"family", "protocol", "state"}, "Entries in the BPF datapath's NAT tables (one per direction of a flow; one per flow for kept verdicts), by state: unreplied, established, closing, kept; in tables larger than the default, as the last sweep counted them."},
		{NATFillRatio, "gauge", []string{"family", "table"}, "How full each NAT table is (entries over capacity): confirmed (two-way flows, never evicted), unreplied (evicted first), keep (kept RETURN verdicts); in tables larger than the default, as the last sweep counted them."},
		{NATEvictable, "counter", nil, "Flows that proved two-way while the confirmed table was full, so that they stayed where entries are evicted: an upper bound on established flows evicted; 0 while --nat-max-entries has room."},
		{NATPortRetries, "counter", nil, "Source port claims that found the port taken and tried another."},
		{NATPortFailures, "counter", nil, "New flows that found no free source port within the probes (each one a dropped packet)."},
		{NATPortAttempts, "histogram", nil, "Probes that successful source port allocations took."},
		{Drops, "counter", []string{"reason"}, "Packets the BPF datapath dropped, by reason: no_port, no_addr (the uplink has no address of the family), rewrite (a rewrite failed), untranslatable (a pod's packet the NAT cannot translate, to a masqueraded destination)."},
		{DatapathEvents, "counter", []string{"event"}, "Events the BPF datapath counted, by event (docs/reference.md lists them): new mappings, port retries, repairs, drops (drop_*, by reason also in " + Drops + ") and more."},
		{NATSwept, "counter", []string{"protocol"}, "NAT table entries the periodic sweep removed as idle."},
		{ConfigReloads, "counter", []string{"result"}, "Reads of the config file by result: success (its policy is in the datapath), invalid (parse or validation failed; the last good configuration stays), address_missing (it names a masquerade address the node does not have; the last good configuration stays), apply_error."},
		{ConfigLastReload, "gauge", nil, "Unix time of the last successful reload; 0 before the first."},
		{ConfigInfo, "gauge", []string{"sha256"}, "Always 1; sha256 is the hash of the canonical form of the configuration in force."},
		{ConfigRejected, "gauge", nil, "1 while the configuration the last reload found is rejected (it does not parse or validate, or names a masquerade address the node lacks), so that an older one, or none, is in force; else 0."},
		{Ready, "gauge", nil, "1 while /readyz answers 200: a configuration is in the datapath, enforced everywhere, with its masquerade addresses on the node; else 0."},
		{DriftPersisting, "gauge", []string{"what"}, "1 for each kind of drift that persists: one no apply can repair (a program ahead of ours ending the chain), or one the last repair did not fix (something keeps changing the datapath); no series while there is none."},
		{SourceReachable, "gauge", nil, "1 while the configuration source reaches the configuration (the API server answers), 0 while not: the configuration in force stays, changes wait. Only for --config-source configmap or crd."},
		{StatusWrites, "counter", []string{"result"}, "Writes of the node's IPMasqAgentNode status (--node-status), by result: success, error. Only heartbeats while nothing changes."},
		{SourceDeleted, "gauge", nil, "1 while the API object the configuration is read from is deleted: the last configuration applied stays in force (a deletion is not an instruction; an object with an empty configuration means the defaults); else 0. Only for --config-source configmap or crd."},
		{StatusLastWrite, "gauge", nil, "Unix time of the last successful write of the node's status (a change or a heartbeat); 0 before the first. Only with --node-status."},
		{StatusHeartbeat, "gauge", nil, "How often the node's status is written when nothing changes (--node-status-heartbeat), in seconds. Only with --node-status."},
		{DatapathFallback, "gauge", []string{"backend"}, "1 for each backend that --backend=auto passed over because it cannot run on this node (not because it does not fit), so that a fallback runs; no series otherwise."},
		{AddressMissing, "gauge", []string{"address"}, "1 for each masquerade address that the configuration in force, or the last one read, names and no uplink of the node has; no series while all are there."},
		{DatapathSyncDuration, "histogram", nil, "Time to apply the policy to the datapath, failed applies included."},
		{SourcePodsApply, "histogram", nil, "Time from the API server's watch event that changed the pods a source rule selects (a pod's labels or address, a namespace's labels, a pod come or gone) to the end of the apply that put them in the datapath."},
		{DatapathSyncErrors, "counter", nil, "Applies of the policy that failed (each is retried)."},
		{DatapathInfo, "gauge", []string{"backend", "attach_mode"}, "Always 1; the datapath backend and how its programs are attached (none for a backend without programs)."},
		{DatapathRefused, "gauge", nil, "1 while the backend refuses to take over what is installed on the node (BPF: pinned maps of a layout newer than the agent's, or of one it does not know), which it leaves alone; the agent is then not ready and retries. 0 otherwise."},
		{BuildInfo, "gauge", []string{"version", "revision", "goversion"}, "Always 1; the agent's version, VCS revision and Go version."},
		{ScrapeErrors, "counter", []string{"source"}, "Scrapes whose read of the datapath failed, by source (rules, nat, hooks); the scrape then leaves those metrics out."},
		{Heals, "counter", []string{"what"}, "Repairs of what was changed behind the agent's back, by kind: " + healsHelp(entries) + "."},
		{HookNeighbours, "gauge", hookLabels("position"), "Programs of other components on an uplink's tc hook (BPF), by position: ahead of ours (their verdict decides whether ours runs) or behind it (ours lets every packet through to them)."},
		{HookBypassed, "gauge", hookLabels(), "1 while a program ahead of ours on the hook ends the chain, so that ours sees none of the device's packets and the policy is not enforced there (BPF); else 0."},
		{HookBypasses, "counter", hookLabels(), "Times a program ahead of ours was found ending the chain on the hook (BPF), each logged once."},
		{UplinkInfo, "gauge", []string{"device", "via", "covered"}, "Always 1, one series per device pod traffic can leave the node by (BPF): via is what makes it one (default route, a route and its table, --interfaces); covered is false where the programs do not run (a device without an Ethernet header), whose pod traffic is not masqueraded."},
	}
}

// countsHelp says what each backend's rule counters count: "every packet (bpf); connections:
// the first packet of each (nftables, iptables)".
func countsHelp(entries []datapath.Entry) string {
	var counts []string
	byCounts := map[string][]string{}
	for _, b := range entries {
		c := cmp.Or(b.Counts, "every packet")
		if byCounts[c] == nil {
			counts = append(counts, c)
		}
		byCounts[c] = append(byCounts[c], b.Name)
	}
	var parts []string
	for _, c := range counts {
		parts = append(parts, c+" ("+strings.Join(byCounts[c], ", ")+")")
	}
	return strings.Join(parts, "; ")
}

// healsHelp lists each backend's kinds of drift: "chain, jump (iptables); ...".
func healsHelp(entries []datapath.Entry) string {
	var parts []string
	for _, b := range entries {
		if len(b.DriftKinds) > 0 {
			parts = append(parts, strings.Join(b.DriftKinds, ", ")+" ("+b.Name+")")
		}
	}
	return strings.Join(parts, "; ")
}

// definition is the Definition named name, of a metric whose help quotes no backend.
func definition(name string) Definition {
	defs := Definitions(nil)
	return defs[slices.IndexFunc(defs, func(d Definition) bool { return d.Name == name })]
}

// Names returns the names of Definitions, in the same order.
func Names() []string {
	defs := Definitions(nil)
	out := make([]string, len(defs))
	for i, d := range defs {
		out[i] = d.Name
	}
	return out
}

// StatsSource is what the collector reads from the agent.
type StatsSource interface {
	Stats() agent.Stats
}

// Observer records the agent's applies as they happen (it is an agent.Observer): their
// durations, failed applies included, in DatapathSyncDuration.
type Observer struct {
	syncDuration, podsApply prometheus.Histogram
}

var (
	_ agent.Observer     = (*Observer)(nil)
	_ agent.PodsObserver = (*Observer)(nil)
)

// syncBuckets are the upper bounds, in seconds, of DatapathSyncDuration's buckets: from a BPF
// map update (a millisecond) to an iptables-restore of thousands of rules or one that waits for
// the xtables lock (up to its 30 s timeout).
var syncBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}

// NewObserver returns an Observer to give to the agent (agent.Options.Observer) and to the
// collector (Options.Observer).
func NewObserver() *Observer {
	def, pods := definition(DatapathSyncDuration), definition(SourcePodsApply)
	return &Observer{syncDuration: prometheus.NewHistogram(prometheus.HistogramOpts{Name: def.Name, Help: def.Help,
		Buckets: syncBuckets}),
		podsApply: prometheus.NewHistogram(prometheus.HistogramOpts{Name: pods.Name, Help: pods.Help, Buckets: syncBuckets})}
}

// ObservePodsApplied implements agent.PodsObserver.
func (o *Observer) ObservePodsApplied(took time.Duration) {
	o.podsApply.Observe(took.Seconds())
}

// ObserveApply implements agent.Observer.
func (o *Observer) ObserveApply(took time.Duration, _ error) {
	o.syncDuration.Observe(took.Seconds())
}

// Options configure a Collector.
type Options struct {
	Backend datapath.Backend
	Agent   StatsSource
	// Entries are the backends (backends.All), for the help of RulePackets and Heals (see
	// Definitions).
	Entries []datapath.Entry
	// Observer, when set, is the one the agent reports to: its metrics are collected too.
	Observer *Observer
	// Logger receives a warning for each failed datapath read; nil discards them.
	Logger *slog.Logger
	// ReadTimeout bounds the datapath reads of one scrape; zero means DefaultReadTimeout.
	ReadTimeout time.Duration
	// Source is where the configuration comes from: one that can lose its way to it
	// (config.Reachable) is reported in SourceReachable.
	Source config.Source
	// Status, when set, is the node status publisher, whose writes are counted.
	Status interface{ Writes() (ok, failed uint64) }
	// Fallback names the backends that --backend=auto passed over because they cannot run on
	// this node (backends.Chosen.CannotRun).
	Fallback []string
	// RuleSeries bounds the rules with series of their own (RulePackets, RuleBytes): a policy of
	// more rules exports the busiest ones (see ruleTable.choose), and every rule counts in the
	// per-origin totals. Zero means DefaultRuleSeries; less than zero, every rule.
	RuleSeries int
}

// Collector is a prometheus.Collector that reads the backend and the agent at scrape time. It
// is safe for concurrent scrapes (the backend's reading methods are, see package datapath).
type Collector struct {
	opts  Options
	log   *slog.Logger
	descs map[string]*prometheus.Desc
	build [3]string
	rules *ruleTable
	// Scrape errors by source, since the collector was created.
	rulesErrors, natErrors, hookErrors atomic.Uint64
}

var _ prometheus.Collector = (*Collector)(nil)

// NewCollector returns a collector of the backend's and the agent's metrics.
func NewCollector(opts Options) *Collector {
	if opts.ReadTimeout <= 0 {
		opts.ReadTimeout = DefaultReadTimeout
	}
	if opts.RuleSeries == 0 {
		opts.RuleSeries = DefaultRuleSeries
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Collector{opts: opts, log: log.With("component", "metrics"), descs: map[string]*prometheus.Desc{},
		build: [3]string{version.Version, version.Revision(), runtime.Version()}, rules: newRuleTable(opts.RuleSeries)}
	for _, d := range Definitions(opts.Entries) {
		if d.Name != DatapathSyncDuration && d.Name != SourcePodsApply { // the Observer's own
			c.descs[d.Name] = prometheus.NewDesc(d.Name, d.Help, d.Labels, nil)
		}
	}
	return c
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
	if c.opts.Observer != nil {
		c.opts.Observer.syncDuration.Describe(ch)
		c.opts.Observer.podsApply.Describe(ch)
	}
}

// Collect implements prometheus.Collector. A datapath read that fails leaves out its own
// metrics, counts in ScrapeErrors and is logged; the rest of the scrape is served.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(name string, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(c.descs[name], prometheus.GaugeValue, v, labels...)
	}
	counter := func(name string, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(c.descs[name], prometheus.CounterValue, float64(v), labels...)
	}
	gauge(BuildInfo, 1, c.build[:]...)
	c.collectSetup(gauge, counter)
	if c.opts.Agent != nil {
		c.collectAgent(c.opts.Agent.Stats(), gauge, counter)
	}
	if c.opts.Observer != nil {
		c.opts.Observer.syncDuration.Collect(ch)
		c.opts.Observer.podsApply.Collect(ch)
	}
	c.collectReads(ch, gauge, counter)
}

// collectSetup collects what the process runs: the datapath, the configuration's source, the
// status writes and the backends auto passed over.
func (c *Collector) collectSetup(gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	info := datapath.Info{Backend: c.opts.Backend.Name(), AttachMode: datapath.AttachNone}
	if r, ok := c.opts.Backend.(datapath.InfoReporter); ok {
		info = r.Info()
	}
	gauge(DatapathInfo, 1, info.Backend, info.AttachMode)
	gauge(DatapathRefused, boolValue(info.Refused != ""))
	if r, ok := c.opts.Source.(config.Reachable); ok {
		gauge(SourceReachable, boolValue(r.Unreachable() == nil))
	}
	if d, ok := c.opts.Source.(config.Deletable); ok {
		gauge(SourceDeleted, boolValue(d.Deleted()))
	}
	if c.opts.Status != nil {
		ok, failed := c.opts.Status.Writes()
		counter(StatusWrites, ok, WriteSuccess)
		counter(StatusWrites, failed, WriteError)
	}
	if h, ok := c.opts.Status.(heartbeater); ok {
		last, every := h.Heartbeat()
		var at float64
		if !last.IsZero() {
			at = float64(last.UnixNano()) / 1e9
		}
		gauge(StatusLastWrite, at)
		gauge(StatusHeartbeat, every.Seconds())
	}
	for _, b := range c.opts.Fallback {
		gauge(DatapathFallback, 1, b)
	}
}

// heartbeater is a node status publisher that renews the status when nothing changes: when it
// last wrote, and how often it writes (nodestatus.Publisher).
type heartbeater interface {
	Heartbeat() (last time.Time, every time.Duration)
}

// collectAgent collects the agent's stats s: reloads, the configuration in force, readiness,
// drift and heals.
func (c *Collector) collectAgent(s agent.Stats, gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	counter(ConfigReloads, s.Reloads, ReloadSuccess)
	counter(ConfigReloads, s.ConfigErrors, ReloadInvalid)
	counter(ConfigReloads, s.ReloadApplyErrors, ReloadApplyError)
	counter(ConfigReloads, s.AddressErrors, ReloadAddressMissing)
	for _, a := range s.MissingAddresses {
		gauge(AddressMissing, 1, a.String())
	}
	var last float64
	if !s.LastReload.IsZero() {
		last = float64(s.LastReload.UnixNano()) / 1e9
	}
	gauge(ConfigLastReload, last)
	if s.ConfigSHA256 != "" {
		gauge(ConfigInfo, 1, s.ConfigSHA256)
	}
	gauge(ConfigRejected, boolValue(s.Rejected != ""))
	gauge(Ready, boolValue(s.NotReady == ""))
	for _, k := range slices.Compact(slices.Sorted(slices.Values(append(slices.Clone(s.Unenforced), s.Persisting...)))) {
		gauge(DriftPersisting, 1, k)
	}
	counter(DatapathSyncErrors, s.ApplyErrors)
	// Every kind the backend can heal is a series from the start, zero or not.
	heals := maps.Clone(s.Heals)
	if heals == nil {
		heals = map[string]uint64{}
	}
	if dc, ok := c.opts.Backend.(datapath.DriftChecker); ok {
		for _, k := range dc.DriftKinds() {
			heals[k] += 0
		}
	}
	for _, k := range slices.Sorted(maps.Keys(heals)) {
		counter(Heals, heals[k], k)
	}
}

// collectReads collects what is read from the datapath at each scrape, within ReadTimeout: the
// rules' counters, the NAT table, the hooks and the uplinks, and the reads that failed.
func (c *Collector) collectReads(ch chan<- prometheus.Metric, gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.ReadTimeout)
	defer cancel()
	c.collectRules(ctx, gauge, counter)
	nat, hasNAT := c.opts.Backend.(datapath.NATReporter)
	if hasNAT {
		c.collectNAT(ctx, ch, nat, gauge, counter)
	}
	hooks, hasHooks := c.opts.Backend.(datapath.HookReporter)
	if hasHooks {
		c.collectHooks(ctx, hooks, gauge, counter)
	}
	if ur, ok := c.opts.Backend.(datapath.UplinkReporter); ok {
		c.collectUplinks(ctx, ur, gauge)
	}
	counter(ScrapeErrors, c.rulesErrors.Load(), SourceRules)
	if hasNAT {
		counter(ScrapeErrors, c.natErrors.Load(), SourceNAT)
	}
	if hasHooks {
		counter(ScrapeErrors, c.hookErrors.Load(), SourceHooks)
	}
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func (c *Collector) collectHooks(ctx context.Context, r datapath.HookReporter, gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	hooks, err := r.Hooks(ctx)
	if err != nil {
		c.hookErrors.Add(1)
		c.log.Warn("scrape: cannot read the hooks; leaving their metrics out", "error", err)
		return
	}
	for _, h := range hooks {
		gauge(HookNeighbours, float64(len(h.Ahead)), h.Device, h.Direction, "ahead")
		gauge(HookNeighbours, float64(len(h.Behind)), h.Device, h.Direction, "behind")
		bypassed := 0.0
		if h.Bypassed {
			bypassed = 1
		}
		gauge(HookBypassed, bypassed, h.Device, h.Direction)
		counter(HookBypasses, h.Bypasses, h.Device, h.Direction)
	}
}

func (c *Collector) collectUplinks(ctx context.Context, r datapath.UplinkReporter, gauge func(string, float64, ...string)) {
	ups, err := r.Uplinks(ctx)
	if err != nil {
		c.hookErrors.Add(1)
		c.log.Warn("scrape: cannot read the uplinks; leaving their metrics out", "error", err)
		return
	}
	for _, u := range ups {
		gauge(UplinkInfo, 1, u.Device, u.Via, strconv.FormatBool(u.Covered))
	}
}

func (c *Collector) collectRules(ctx context.Context, gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	rules, err := c.opts.Backend.Counters(ctx)
	if err != nil {
		c.rulesErrors.Add(1)
		c.log.Warn("scrape: cannot read the rule counters; leaving them out", "error", err)
		return
	}
	s := c.rules.scrape(rules)
	for _, r := range s.rules {
		labels := []string{r.Family.String(), r.Action.String(), r.Prefix.String(), originLabel(r.Set, r.Origin)}
		counter(RulePackets, r.Packets, labels...)
		counter(RuleBytes, r.Bytes, labels...)
	}
	for _, o := range s.origins {
		labels := []string{o.family.String(), o.action.String(), originLabel(o.set, o.origin)}
		counter(OriginPackets, o.packets, labels...)
		counter(OriginBytes, o.bytes, labels...)
	}
	for _, fam := range policy.Families() {
		if n, ok := s.perFamily[fam]; ok {
			gauge(Rules, float64(n), fam.String())
		}
	}
}

// originLabel is the origin label of a rule: its origin, and for a source rule's, the rule's
// name before it (sourceRules[batch].nonMasqueradeCIDRs), so that a source rule adds one value
// per origin, and the global lists' series stay what they were before source rules.
func originLabel(set string, origin policy.Origin) string {
	if set == "" {
		return string(origin)
	}
	return config.KeySourceRules + "[" + set + "]." + string(origin)
}

func (c *Collector) collectNAT(ctx context.Context, ch chan<- prometheus.Metric, nat datapath.NATReporter, gauge func(string, float64, ...string), counter func(string, uint64, ...string)) {
	st, err := nat.NATStats(ctx)
	if err != nil {
		c.natErrors.Add(1)
		c.log.Warn("scrape: cannot read the NAT table; leaving its metrics out", "error", err)
		return
	}
	type entryKey struct{ family, protocol, state string }
	entries := map[entryKey]uint64{}
	var order []entryKey
	for _, e := range st.Entries {
		k := entryKey{e.Family.String(), e.Protocol, e.State}
		if _, ok := entries[k]; !ok {
			order = append(order, k)
		}
		entries[k] += e.Entries
	}
	for _, k := range order {
		gauge(NATEntries, float64(entries[k]), k.family, k.protocol, k.state)
	}
	for _, t := range st.Tables {
		if t.Capacity > 0 {
			gauge(NATFillRatio, float64(t.Entries)/float64(t.Capacity), t.Family.String(), t.Table)
		}
	}
	counter(NATEvictable, st.EstablishedEvictable)
	counter(NATPortRetries, st.PortAllocationRetries)
	counter(NATPortFailures, st.PortAllocationFailures)
	h := st.PortAttempts
	buckets := make(map[float64]uint64, len(h.Bounds))
	var cum uint64
	for i, bound := range h.Bounds {
		cum += h.Counts[i]
		buckets[bound] = cum
	}
	ch <- prometheus.MustNewConstHistogram(c.descs[NATPortAttempts], cum, h.Sum, buckets)
	for reason, n := range st.Drops {
		counter(Drops, n, reason)
	}
	for event, n := range st.Events {
		counter(DatapathEvents, n, event)
	}
	for proto, n := range st.Swept {
		counter(NATSwept, n, proto)
	}
}

// NewRegistry returns a registry of its own (not the global default) with the agent's
// collector and client_golang's Go runtime and process collectors.
func NewRegistry(opts Options) (*prometheus.Registry, error) {
	reg := prometheus.NewRegistry()
	for _, c := range []prometheus.Collector{
		NewCollector(opts),
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
	} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return reg, nil
}

// Handler serves the registry in the Prometheus exposition formats. A metric that fails to
// gather is logged and left out; the rest is served.
func Handler(reg *prometheus.Registry, log *slog.Logger) http.Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorLog:      slog.NewLogLogger(log.With("component", "metrics").Handler(), slog.LevelWarn),
		ErrorHandling: promhttp.ContinueOnError,
	})
}
