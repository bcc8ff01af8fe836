package nodestatus

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"reflect"
	"sync"
	"sync/atomic"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/agent"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/datapath"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// Defaults of Options.
const (
	// DefaultDelay spreads a fleet's writes: 5,000 nodes that change at once (a new
	// configuration) write 500 a second over 10 s, as many as their kubelets' node leases do.
	DefaultDelay = 10 * time.Second
	// DefaultHeartbeat is how often a status that does not change is written again (its
	// lastHeartbeatTime): 5,000 nodes write 5,000 / 300 s = 17 a second, 3% of what their
	// kubelets' node leases write (5,000 / 10 s = 500 a second), and a status older than three
	// heartbeats (15 minutes) tells of an agent that is gone or cannot write.
	DefaultHeartbeat = 5 * time.Minute
	// pollInterval is how often the agent's state is compared with the status written: a
	// snapshot of counters, no I/O.
	pollInterval = time.Second
	// natInterval is how often the NAT tables' fill is read: a walk of the tables, which takes
	// a while at a million flows.
	natInterval = 30 * time.Second
	// writeTimeout bounds one write; retryMax bounds the backoff of failing ones.
	writeTimeout = 10 * time.Second
	retryMax     = 5 * time.Minute
)

// FieldManager is the agent's name for server-side apply.
const FieldManager = "ip-masq-agent"

// Options configure a Publisher.
type Options struct {
	// Node is the node's name, and so its IPMasqAgentNode's.
	Node string
	// Agent and Backend are read for the status; Source names where the configuration comes
	// from.
	Agent   interface{ Stats() agent.Stats }
	Backend datapath.Backend
	Source  string
	// Reason and Fallback say why the backend runs (backends.Chosen.Reason, CannotRun).
	Reason   string
	Fallback []string
	// Delay is the most a change waits before it is written, and the least time between two
	// writes; zero means DefaultDelay.
	Delay time.Duration
	// Heartbeat is how often the status is written when nothing changes (less up to a tenth,
	// at random, so that a fleet's heartbeats spread); zero means DefaultHeartbeat.
	Heartbeat time.Duration
	// Deleted, when set, is the configuration's source if it reads an API object: its deletion
	// is told in the ConfigObjectPresent condition.
	Deleted config.Deletable
	// Logger receives the publisher's logs; nil discards them.
	Logger *slog.Logger
}

// Publisher writes the node's status when it changes.
type Publisher struct {
	opts  Options
	log   *slog.Logger
	nodes dynamic.ResourceInterface
	core  dynamic.NamespaceableResourceInterface
	// written is the status last written (without its heartbeat), nil before the first write.
	written *kube.NodeStatus
	// object is the metadata last applied to the object itself (the status is written through
	// its status subresource, which creates nothing), nil until the object is known to exist.
	object map[string]any
	// lastWrite is when the status was last written, in Unix nanoseconds; 0 before the first.
	lastWrite atomic.Int64
	// owner is the Node's reference, nil until read; noOwner is set once that failed (and was
	// logged).
	owner   *metav1.OwnerReference
	noOwner bool
	// failing is the reason of the failing writes, as last logged; "" while they succeed.
	failing string
	// Writes that succeeded and failed.
	writes, failures atomic.Uint64

	mu      sync.Mutex
	natFull string // fullTables' last answer
}

// New returns a publisher writing through the API server cfg names; it writes nothing until Run.
func New(cfg *rest.Config, opts Options) (*Publisher, error) {
	if opts.Node == "" {
		return nil, fmt.Errorf("node status: no node name (--node-name, or NODE_NAME from the downward API)")
	}
	if opts.Delay <= 0 {
		opts.Delay = DefaultDelay
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = DefaultHeartbeat
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("node status: API client: %w", err)
	}
	return &Publisher{opts: opts, log: log.With("component", "nodestatus", "node", opts.Node),
		nodes: c.Resource(kube.Nodes.GVR()), core: c.Resource(schema.GroupVersionResource{Version: "v1", Resource: "nodes"})}, nil
}

// Writes returns how many writes of the status succeeded and failed.
func (p *Publisher) Writes() (ok, failed uint64) { return p.writes.Load(), p.failures.Load() }

// Heartbeat returns when the status was last written (zero before the first write) and how
// often it is written when nothing changes.
func (p *Publisher) Heartbeat() (last time.Time, every time.Duration) {
	if n := p.lastWrite.Load(); n != 0 {
		last = time.Unix(0, n)
	}
	return last, p.opts.Heartbeat
}

// Run publishes until ctx is done: it compares the agent's state with the status written every
// pollInterval, and writes a changed one after a random part of Delay, Delay after the previous
// write at the earliest (the first: Delay after the start, by when the first configuration is
// usually in); an unchanged one is written again once its heartbeat is due. A failed write is
// retried, backing off up to retryMax.
func (p *Publisher) Run(ctx context.Context) {
	go p.watchNAT(ctx)
	poll := time.NewTicker(pollInterval)
	defer poll.Stop()
	write := time.NewTimer(time.Hour)
	write.Stop()
	lastWrite, pending, backoff := time.Now(), false, time.Duration(0)
	beat := p.nextBeat(lastWrite)
	for {
		select {
		case <-ctx.Done():
			write.Stop()
			return
		case <-poll.C:
			if pending || (p.current() == nil && !p.beatDue(beat)) {
				continue
			}
			at := max(time.Until(lastWrite.Add(p.opts.Delay)), rand.N(p.opts.Delay))
			write.Reset(at)
			pending = true
		case <-write.C:
			pending = false
			st := p.current()
			if st == nil {
				if !p.beatDue(beat) {
					continue // changed back meanwhile
				}
				st = p.written
			}
			if err := p.write(ctx, st); err != nil {
				backoff = min(max(2*backoff, p.opts.Delay), retryMax)
				write.Reset(backoff)
				pending = true
				continue
			}
			lastWrite, backoff = time.Now(), 0
			beat = p.nextBeat(lastWrite)
		}
	}
}

// nextBeat is when the heartbeat after a write at last is due: Heartbeat later, less up to a
// tenth of it at random, so that nodes that wrote together (a new configuration) drift apart.
func (p *Publisher) nextBeat(last time.Time) time.Time {
	return last.Add(p.opts.Heartbeat - rand.N(p.opts.Heartbeat/10+1))
}

// beatDue says whether a status was written and its heartbeat, due at beat, is.
func (p *Publisher) beatDue(beat time.Time) bool {
	return p.written != nil && !time.Now().Before(beat)
}

// current returns the status to write, nil when it is the one written.
func (p *Publisher) current() *kube.NodeStatus {
	f := facts{stats: p.opts.Agent.Stats(), source: p.opts.Source, reason: p.opts.Reason, fallback: p.opts.Fallback,
		info: datapath.Info{Backend: p.opts.Backend.Name(), AttachMode: datapath.AttachNone}}
	if r, ok := p.opts.Backend.(datapath.InfoReporter); ok {
		f.info = r.Info()
	}
	_, f.nat = p.opts.Backend.(datapath.NATReporter)
	if p.opts.Deleted != nil {
		f.object, f.deleted = true, p.opts.Deleted.Deleted()
	}
	p.mu.Lock()
	f.full = p.natFull
	p.mu.Unlock()
	var conditions []metav1.Condition
	if p.written != nil {
		conditions = p.written.Conditions
	}
	st := build(f, conditions)
	if p.written != nil && reflect.DeepEqual(st, *p.written) {
		return nil
	}
	return &st
}

// watchNAT reads the NAT tables' fill every natInterval, for the NATTableHasRoom condition.
func (p *Publisher) watchNAT(ctx context.Context) {
	nat, ok := p.opts.Backend.(datapath.NATReporter)
	if !ok {
		return
	}
	t := time.NewTicker(natInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, natInterval)
		st, err := nat.NATStats(rctx)
		cancel()
		if err != nil {
			continue // the metrics count failed reads; the condition keeps its last answer
		}
		p.mu.Lock()
		p.natFull = fullTables(st, p.natFull != "")
		p.mu.Unlock()
	}
}

// write applies the status with a new heartbeat, through the status subresource (server-side
// apply: only the agent's own fields are touched). The object itself, owned by the Node so that
// it goes away with it, is applied first when it is not known to exist, or its metadata changed.
func (p *Publisher) write(ctx context.Context, st *kube.NodeStatus) error {
	ctx, cancel := context.WithTimeout(ctx, writeTimeout)
	defer cancel()
	if err := p.ensureObject(ctx); err != nil {
		return p.failed(err, "create and patch on "+kube.Nodes.Plural+"."+kube.Group)
	}
	beat := *st
	now := metav1.NewTime(time.Now().Truncate(time.Second))
	beat.LastHeartbeatTime = &now
	err := p.applyStatus(ctx, &beat)
	if apierrors.IsNotFound(err) {
		p.object = nil // deleted meanwhile: the retry creates it again
	}
	if err != nil {
		return p.failed(err, "patch on "+kube.Nodes.Plural+"/status."+kube.Group)
	}
	if p.written == nil || p.failing != "" {
		p.log.Info("node status written", "object", kube.Nodes.Kind+" "+p.opts.Node, "state", st.State)
	}
	p.failing = ""
	p.writes.Add(1)
	p.lastWrite.Store(now.UnixNano())
	p.written = st
	return nil
}

// ensureObject applies the object's metadata unless it is what was applied last.
func (p *Publisher) ensureObject(ctx context.Context) error {
	md := p.metadata(ctx)
	if p.object != nil && reflect.DeepEqual(md, p.object) {
		return nil
	}
	if _, err := p.apply(ctx, md, nil, ""); err != nil {
		return err
	}
	p.object = md
	return nil
}

// applyStatus applies st through the status subresource. The process's first write also
// replaces a status that holds more than st: fields that an agent of an older version wrote
// before the CRD had the status subresource are owned by no one since, so that an apply that
// leaves them out (a message, a rejection that no longer is) would not remove them.
func (p *Publisher) applyStatus(ctx context.Context, st *kube.NodeStatus) error {
	obj, err := p.apply(ctx, map[string]any{"name": p.opts.Node}, st, "status")
	if err != nil || p.written != nil || sameStatus(obj, st) {
		return err
	}
	if _, err := p.nodes.Patch(ctx, p.opts.Node, types.MergePatchType, []byte(`{"status":null}`),
		metav1.PatchOptions{FieldManager: FieldManager}, "status"); err != nil {
		return err
	}
	p.log.Info("replaced the node's status, which held fields this agent does not write")
	_, err = p.apply(ctx, map[string]any{"name": p.opts.Node}, st, "status")
	return err
}

// sameStatus says whether obj's status is st, compared as JSON.
func sameStatus(obj *unstructured.Unstructured, st *kube.NodeStatus) bool {
	var have, want any
	a, errA := json.Marshal(obj.Object["status"])
	b, errB := json.Marshal(st)
	if errA != nil || errB != nil || json.Unmarshal(a, &have) != nil || json.Unmarshal(b, &want) != nil {
		return false
	}
	return reflect.DeepEqual(have, want)
}

// apply applies the object of metadata md and, when set, status st, to subresource (none: "").
func (p *Publisher) apply(ctx context.Context, md map[string]any, st *kube.NodeStatus, subresource string) (*unstructured.Unstructured, error) {
	obj := map[string]any{"apiVersion": kube.Nodes.APIVersion(), "kind": kube.Nodes.Kind, "metadata": md}
	if st != nil {
		obj["status"] = st
	}
	data, err := json.Marshal(obj)
	if err != nil {
		return nil, err
	}
	var sub []string
	if subresource != "" {
		sub = []string{subresource}
	}
	force := true
	return p.nodes.Patch(ctx, p.opts.Node, types.ApplyPatchType, data, metav1.PatchOptions{FieldManager: FieldManager, Force: &force}, sub...)
}

// failed counts a failed write and logs it, once for each reason in a row; need is the
// permission it calls for when it was refused one.
func (p *Publisher) failed(err error, need string) error {
	p.failures.Add(1)
	reason := string(apierrors.ReasonForError(err))
	if reason == "" {
		reason = "NoAnswer" // not the API server's word: it was not reached
	}
	if reason != p.failing {
		p.failing = reason
		attrs := []any{"error", err}
		if apierrors.IsForbidden(err) {
			attrs = append(attrs, "need", need)
		}
		p.log.Warn("cannot write the node's status; retrying", attrs...)
	}
	return err
}

// metadata is the object's name and, once the Node could be read, its owner reference.
func (p *Publisher) metadata(ctx context.Context) map[string]any {
	md := map[string]any{"name": p.opts.Node, "labels": map[string]any{"app.kubernetes.io/name": "ip-masq-agent"}}
	if p.owner == nil {
		n, err := p.core.Get(ctx, p.opts.Node, metav1.GetOptions{})
		if err != nil {
			if !p.noOwner {
				p.log.Warn("cannot read the Node; its status object is published without an owner, and outlives the node",
					"error", err, "need", "get on nodes")
			}
			p.noOwner = true
			return md
		}
		p.owner = &metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: n.GetName(), UID: n.GetUID()}
	}
	md["ownerReferences"] = []metav1.OwnerReference{*p.owner}
	return md
}
