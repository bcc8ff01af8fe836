// Package podsource tells which of the node's pods each source rule with label selectors
// chooses (config.SourceRule.Selects): the addresses policy.Options.Pods takes. It watches the
// API server through two informers: the pods of this node only (a field selector on
// spec.nodeName, so that a fleet's agents together read each pod once) and the namespaces'
// metadata (their labels, for namespaceSelector).
//
// A pod counts with the addresses of its status.podIPs while it runs or waits to: a pod on the
// host's network (its address is the node's) and a pod that has ended (phase Succeeded or
// Failed, its address free for another) have none. An address two pods claim belongs to the
// newer: the old pod's status may lag behind the new pod's start.
//
// While the API server cannot be reached the informers keep what they last saw: the mapping
// stays as it was, nothing is flushed; the watcher logs the loss once and the return once.
package podsource

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
)

// ErrUnknown is what Select returns, wrapped with why, until the informers have listed the
// node's pods and the namespaces: the watcher reports a change once they have.
var ErrUnknown = errors.New("the node's pods are not known yet")

// Permission is the RBAC the watcher needs, for messages.
const Permission = "list and watch on pods (of the node, field spec.nodeName) and on namespaces"

// Options configure a Watcher.
type Options struct {
	// Node is the name of the node whose pods are watched.
	Node string
	// Logger receives the watcher's logs; nil discards them.
	Logger *slog.Logger
}

// Watcher follows the node's pods and the namespaces' labels, and maps the selector rules it
// is given (Select) to the addresses of the pods each chooses.
type Watcher struct {
	pods, namespaces cache.ListerWatcher
	log              *slog.Logger
	changes          *config.Changes
	// dirty wakes the worker that computes the mapping again after an event.
	dirty chan struct{}
	// running counts the informers' goroutines: Watch's channel closes once they have ended.
	running sync.WaitGroup

	mu sync.Mutex
	// parent is Watch's context, nil before Watch; the informers run under a child of it while
	// there are rules to follow, and stop otherwise (stop).
	parent context.Context
	stop   context.CancelFunc
	podInf cache.SharedIndexInformer
	nsInf  cache.SharedIndexInformer
	// selectors are those of the selector rules followed, converted once.
	selectors []selector
	// current is the mapping as last computed for rules; valid once the informers synced.
	current map[string][]netip.Addr
	synced  bool
	// event is when the first event not yet computed arrived; since when the first change of
	// current not yet taken by Select did.
	event, since time.Time
	// lost says why the API server cannot be read, nil while it answers.
	lost error
}

type selector struct {
	name            string
	namespaces, pod labels.Selector
}

// New returns a watcher of the pods of opts.Node through the API server cfg names; it touches
// nothing until Watch and Select.
func New(cfg *rest.Config, opts Options) (*Watcher, error) {
	if opts.Node == "" {
		return nil, errors.New("pod source: no node name")
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// The core group's typed client only: the clientset would bring in every group's.
	core, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API metadata client: %w", err)
	}
	w := &Watcher{log: log.With("component", "pods", "node", opts.Node), changes: config.NewChanges(),
		dirty: make(chan struct{}, 1)}
	onNode := func(o metav1.ListOptions) metav1.ListOptions {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", opts.Node).String()
		return o
	}
	// Every list and watch tells whether the API server answers.
	w.pods = &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			out, err := core.Pods(metav1.NamespaceAll).List(ctx, onNode(o))
			w.answered(err)
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			out, err := core.Pods(metav1.NamespaceAll).Watch(ctx, onNode(o))
			w.answered(err)
			return out, err
		},
	}
	namespaces := meta.Resource(corev1.SchemeGroupVersion.WithResource("namespaces"))
	w.namespaces = &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			out, err := namespaces.List(ctx, o)
			w.answered(err)
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			out, err := namespaces.Watch(ctx, o)
			w.answered(err)
			return out, err
		},
	}
	return w, nil
}

// Watch starts the watcher: the channel receives a value whenever the mapping of the rules of
// the last Select changed (bursts coalesce into one), and once the informers first listed all,
// and is closed once the watcher has stopped, after ctx is done. It is called once, before
// Select; no informer runs until Select names a rule.
func (w *Watcher) Watch(ctx context.Context) (<-chan struct{}, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.parent != nil {
		return nil, errors.New("pod source: Watch called twice")
	}
	w.parent = ctx
	go func() {
		defer w.changes.Stop()
		for {
			select {
			case <-ctx.Done():
				w.mu.Lock()
				w.stopInformers()
				w.mu.Unlock()
				w.running.Wait()
				return
			case <-w.dirty:
				w.recompute()
			}
		}
	}()
	return w.changes.C(), nil
}

// Select makes rules' selector rules the ones followed, and returns by rule name the addresses
// of the node's pods each chooses now, with when the first event that changed them arrived
// since the last Select (zero when none did). Without a selector rule the informers stop and
// Select returns nil. Until the informers have listed all it returns an error wrapping
// ErrUnknown.
func (w *Watcher) Select(rules []config.SourceRule) (map[string][]netip.Addr, time.Time, error) {
	var sels []selector
	for _, r := range rules {
		if r.Selects() {
			ns, pod := r.Selectors()
			sels = append(sels, selector{name: r.Name, namespaces: ns, pod: pod})
		}
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.parent == nil {
		return nil, time.Time{}, errors.New("pod source: Select before Watch")
	}
	since := w.since
	w.since = time.Time{}
	if len(sels) == 0 {
		if w.stop != nil {
			w.log.Info("no source rule selects pods; stopped watching them")
		}
		w.stopInformers()
		w.selectors, w.current = nil, nil
		return nil, since, nil
	}
	w.selectors = sels
	if w.stop == nil {
		if err := w.startInformers(); err != nil {
			return nil, since, err
		}
	}
	if !w.synced {
		why := "waiting for the API server's first answer"
		if w.lost != nil {
			why = "the API server does not answer: " + w.lost.Error()
			if apierrors.IsForbidden(w.lost) {
				why += "; the agent needs " + Permission
			}
		}
		return nil, since, fmt.Errorf("%w: %s", ErrUnknown, why)
	}
	w.current = w.mapping()
	return cloneMapping(w.current), since, nil
}

// Unreachable tells why the API server cannot be read, nil while it answers.
func (w *Watcher) Unreachable() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.lost
}

// startInformers starts the informers under a child of the parent context; w.mu is held.
func (w *Watcher) startInformers() error {
	if err := w.parent.Err(); err != nil {
		return fmt.Errorf("pod source stopped: %w", err) // Watch's goroutine waits for the informers
	}
	pods := cache.NewSharedIndexInformerWithOptions(w.pods, &corev1.Pod{}, cache.SharedIndexInformerOptions{})
	nss := cache.NewSharedIndexInformerWithOptions(w.namespaces, &metav1.PartialObjectMetadata{}, cache.SharedIndexInformerOptions{})
	for _, inf := range []struct {
		cache.SharedIndexInformer
		transform cache.TransformFunc
	}{{pods, trimPod}, {nss, trimNamespace}} {
		if err := inf.SetTransform(inf.transform); err != nil {
			return err
		}
		// The informer keeps its store through the error and retries: the mapping stays.
		if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) { w.answered(err) }); err != nil {
			return err
		}
		if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc: func(any) { w.changed() }, UpdateFunc: func(any, any) { w.changed() }, DeleteFunc: func(any) { w.changed() },
		}); err != nil {
			return err
		}
	}
	ctx, stop := context.WithCancel(w.parent)
	w.stop, w.podInf, w.nsInf, w.synced = stop, pods, nss, false
	w.running.Go(func() { pods.RunWithContext(ctx) })
	w.running.Go(func() { nss.RunWithContext(ctx) })
	w.running.Go(func() {
		// WaitFor, unlike WaitForCacheSync, does not poll (every 100 ms): the first apply waits
		// for this.
		if !cache.WaitFor(ctx, "", pods.HasSyncedChecker(), nss.HasSyncedChecker()) {
			return
		}
		w.mu.Lock()
		if w.podInf == pods { // not stopped and started again meanwhile
			w.synced = true
			w.log.Info("listed the node's pods and the namespaces' labels; following their changes")
		}
		w.mu.Unlock()
		w.changed()
	})
	w.log.Info("the configuration selects pods; watching the node's pods and the namespaces' labels", "rules", len(w.selectors))
	return nil
}

// stopInformers stops the informers, which forget what they saw; w.mu is held.
func (w *Watcher) stopInformers() {
	if w.stop != nil {
		w.stop()
	}
	w.stop, w.podInf, w.nsInf, w.synced = nil, nil, nil, false
}

// changed is every informer event: the worker computes the mapping again.
func (w *Watcher) changed() {
	w.mu.Lock()
	if w.event.IsZero() {
		w.event = time.Now()
	}
	w.mu.Unlock()
	select {
	case w.dirty <- struct{}{}:
	default:
	}
}

// recompute computes the mapping of the rules followed, and reports a change when it differs
// from the last one (or is the first).
func (w *Watcher) recompute() {
	w.mu.Lock()
	event := w.event
	w.event = time.Time{}
	if !w.synced {
		w.mu.Unlock()
		return
	}
	m := w.mapping()
	first := w.current == nil
	same := !first && equalMapping(m, w.current)
	if !same {
		w.current = m
		if w.since.IsZero() {
			w.since = event
		}
	}
	w.mu.Unlock()
	if !same {
		w.changes.Notify()
	}
}

// mapping computes, by selector rule, the addresses of the pods it chooses; w.mu is held and
// the informers synced.
func (w *Watcher) mapping() map[string][]netip.Addr {
	owners := map[netip.Addr]*corev1.Pod{}
	for _, o := range w.podInf.GetStore().List() {
		pod := o.(*corev1.Pod)
		for _, a := range Addresses(pod) {
			if have, ok := owners[a]; !ok || newer(pod, have) {
				owners[a] = pod
			}
		}
	}
	out := make(map[string][]netip.Addr, len(w.selectors))
	for _, s := range w.selectors {
		out[s.name] = []netip.Addr{}
	}
	nsLabels := map[string]labels.Set{}
	for a, pod := range owners {
		set, ok := nsLabels[pod.Namespace]
		if !ok {
			// A namespace not listed yet has no labels: its event brings them and a recompute.
			if o, exists, _ := w.nsInf.GetStore().GetByKey(pod.Namespace); exists {
				set = o.(*metav1.PartialObjectMetadata).Labels
			}
			nsLabels[pod.Namespace] = set
		}
		for _, s := range w.selectors {
			if s.namespaces.Matches(set) && s.pod.Matches(labels.Set(pod.Labels)) {
				out[s.name] = append(out[s.name], a)
			}
		}
	}
	for _, as := range out {
		slices.SortFunc(as, netip.Addr.Compare)
	}
	return out
}

// Addresses are the addresses a pod holds: those of status.podIPs, none for a pod on the host's
// network or one that has ended.
func Addresses(pod *corev1.Pod) []netip.Addr {
	if pod.Spec.HostNetwork || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return nil
	}
	var out []netip.Addr
	for _, ip := range pod.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// newer tells whether a was created after b (by UID where the creation times are equal, so that
// the choice is stable).
func newer(a, b *corev1.Pod) bool {
	if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
		return b.CreationTimestamp.Before(&a.CreationTimestamp)
	}
	return a.UID > b.UID
}

// trimPod keeps what the mapping reads of a pod: 110 pods' specs and statuses are most of an
// informer's memory otherwise.
func trimPod(o any) (any, error) {
	pod, ok := o.(*corev1.Pod)
	if !ok {
		return o, nil // a tombstone
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: pod.Name, Namespace: pod.Namespace, UID: pod.UID, Labels: pod.Labels,
			ResourceVersion: pod.ResourceVersion, CreationTimestamp: pod.CreationTimestamp},
		Spec:   corev1.PodSpec{NodeName: pod.Spec.NodeName, HostNetwork: pod.Spec.HostNetwork},
		Status: corev1.PodStatus{Phase: pod.Status.Phase, PodIPs: pod.Status.PodIPs},
	}, nil
}

// trimNamespace keeps a namespace's name and labels.
func trimNamespace(o any) (any, error) {
	ns, ok := o.(*metav1.PartialObjectMetadata)
	if !ok {
		return o, nil
	}
	return &metav1.PartialObjectMetadata{TypeMeta: ns.TypeMeta, ObjectMeta: metav1.ObjectMeta{Name: ns.Name, UID: ns.UID,
		Labels: ns.Labels, ResourceVersion: ns.ResourceVersion}}, nil
}

// answered records what a request to the API server found: an answer (err nil, or a watch's
// version too old, which a relist mends), or why there was none; a loss is logged once, with
// what it calls for, and the return once.
func (w *Watcher) answered(err error) {
	if err != nil && (apierrors.IsResourceExpired(err) || apierrors.IsGone(err)) {
		err = nil
	}
	w.mu.Lock()
	was := w.lost
	w.lost = err
	w.mu.Unlock()
	switch {
	case err == nil && was == nil:
	case err == nil:
		w.log.Info("the API server answers again; the selected pods follow it again", "was", was.Error())
	case was != nil && apierrors.ReasonForError(err) == apierrors.ReasonForError(was):
	default:
		attrs := []any{"error", err}
		if apierrors.IsForbidden(err) {
			attrs = append(attrs, "need", Permission)
		}
		w.log.Warn("cannot read the node's pods from the API server; the selected pods stay as they were until it answers", attrs...)
	}
}

func equalMapping(a, b map[string][]netip.Addr) bool {
	return maps.EqualFunc(a, b, func(x, y []netip.Addr) bool { return slices.Equal(x, y) })
}

func cloneMapping(m map[string][]netip.Addr) map[string][]netip.Addr {
	out := make(map[string][]netip.Addr, len(m))
	for k, v := range m {
		out[k] = slices.Clone(v)
	}
	return out
}
