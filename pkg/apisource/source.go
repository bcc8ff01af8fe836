// Package apisource reads the agent's configuration from the API server (config.Source): the
// ip-masq-agent ConfigMap, or an IPMasqAgentConfig, each one named object watched through a
// client-go informer. A change reaches the agent as the watch event arrives, where a ConfigMap
// mounted as a file waits for the kubelet's sync (about a minute). While the API server cannot
// be reached the informer's last copy stays what Load returns: the configuration in force stays,
// and the source says so once, and again when the server answers.
//
// A deleted object is not an instruction: the configuration in force stays (Load returns
// config.ErrUnavailable, Deleted says so), the source warns once, and the agent follows the
// object again once it is created again; an object without a configuration (an empty spec, a
// ConfigMap without the key) is how an operator asks for the defaults. Only an agent that starts
// while there is no object applies the defaults, as for a missing file. An edit that leaves the
// configuration as it was (labels, annotations) is not reported, and keeps the revision: it costs
// the fleet no reload and no status write.
package apisource

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/rollout"
)

// Kinds of object the source reads (the --config-source values besides "file").
const (
	KindConfigMap = "configmap"
	KindConfig    = "crd"
)

// Object names what the source reads: a ConfigMap (its ConfigMapKey) or an IPMasqAgentConfig
// (its spec).
type Object struct {
	Kind string
	// Namespace is the ConfigMap's; an IPMasqAgentConfig is cluster-scoped.
	Namespace, Name string
}

// ParseObject reads a --config-source value that names an API object: "configmap" or
// "configmap:NAMESPACE/NAME" (default kube-system/ip-masq-agent), "crd" or "crd:NAME" (default
// default).
func ParseObject(s string) (Object, error) {
	kind, name, named := strings.Cut(s, ":")
	switch kind {
	case KindConfigMap:
		o := Object{Kind: kind, Namespace: kube.DefaultConfigMapNamespace, Name: kube.DefaultConfigMapName}
		if named {
			var ok bool
			if o.Namespace, o.Name, ok = strings.Cut(name, "/"); !ok || o.Namespace == "" || o.Name == "" {
				return Object{}, fmt.Errorf("config-source %q: want configmap:NAMESPACE/NAME", s)
			}
		}
		return o, nil
	case KindConfig:
		o := Object{Kind: kind, Name: kube.DefaultConfigName}
		if named {
			if o.Name = name; name == "" || strings.Contains(name, "/") {
				return Object{}, fmt.Errorf("config-source %q: want crd:NAME (IPMasqAgentConfigs are cluster-scoped)", s)
			}
		}
		return o, nil
	}
	return Object{}, fmt.Errorf("config-source %q: want file, configmap[:NAMESPACE/NAME] or crd[:NAME]", s)
}

// String names the object as kubectl does: "configmap kube-system/ip-masq-agent",
// "ipmasqagentconfig default".
func (o Object) String() string {
	if o.Kind == KindConfigMap {
		return "configmap " + o.Namespace + "/" + o.Name
	}
	return strings.ToLower(kube.Configs.Kind) + " " + o.Name
}

// permission is the RBAC rule the source needs, for messages.
func (o Object) permission() string {
	if o.Kind == KindConfigMap {
		return fmt.Sprintf("get, list and watch on configmaps %q in the namespace %s", o.Name, o.Namespace)
	}
	return fmt.Sprintf("get, list and watch on %s.%s %q", kube.Configs.Plural, kube.Group, o.Name)
}

// Options configure a Source.
type Options struct {
	// Config says how the configuration is read, as for a file.
	Config config.Options
	// Node is the node's name, which places it in a rollout's waves (an IPMasqAgentConfig's);
	// empty is a node no rollout releases before the last wave.
	Node string
	// Logger receives the source's logs; nil discards them.
	Logger *slog.Logger
}

// Source is an API object as a config.Source.
type Source struct {
	obj  Object
	lw   *cache.ListWatch
	opts Options
	log  *slog.Logger

	mu       sync.Mutex
	informer cache.SharedIndexInformer // nil before Watch
	changes  *config.Changes
	// lost says why the API server cannot be read, nil while it answers.
	lost     error
	revision config.Revision // of the last Load
	// doc is the document the last Load read, nil for none: an object whose document is the
	// same keeps its revision.
	doc []byte
	// deleted is true from the deletion of the object until it is created again.
	deleted bool
	// held is the last generation a rollout kept from this node, logged once.
	held int64
}

var (
	_ config.Source     = (*Source)(nil)
	_ config.Revisioned = (*Source)(nil)
	_ config.Reachable  = (*Source)(nil)
	_ config.Deletable  = (*Source)(nil)
)

// New returns the source of obj, read through the API server cfg names; it touches nothing
// until Watch.
func New(cfg *rest.Config, obj Object, opts Options) (*Source, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Source{obj: obj, opts: opts, log: log.With("component", "config", "source", obj.String()),
		changes: config.NewChanges()}
	// Only the one object: a field selector on its name, which RBAC's resourceNames allows.
	only := func(o metav1.ListOptions) metav1.ListOptions {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", obj.Name).String()
		return o
	}
	// The dynamic client, for the ConfigMap too: the typed one would bring every API group's
	// types into the binary (20 MB).
	c, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("API client: %w", err)
	}
	var res dynamic.ResourceInterface
	switch obj.Kind {
	case KindConfigMap:
		res = c.Resource(configMaps).Namespace(obj.Namespace)
	case KindConfig:
		res = c.Resource(kube.Configs.GVR())
	default:
		return nil, fmt.Errorf("config source: unknown kind %q", obj.Kind)
	}
	// Every list and watch the informer makes tells whether the API server answers.
	s.lw = &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			out, err := res.List(ctx, only(o))
			s.answered(err)
			return out, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			out, err := res.Watch(ctx, only(o))
			s.answered(err)
			return out, err
		},
	}
	return s, nil
}

func (s *Source) String() string { return s.obj.String() }

// Watch implements config.Source: it starts the informer, which lists the object and then
// watches it. A change is reported at every event of the object, once the first list is in, and
// whenever the API server stops or starts answering.
func (s *Source) Watch(ctx context.Context) (<-chan struct{}, error) {
	inf := cache.NewSharedIndexInformerWithOptions(s.lw, &unstructured.Unstructured{}, cache.SharedIndexInformerOptions{})
	if err := inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		s.answered(err)
	}); err != nil {
		return nil, err
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: s.added, UpdateFunc: s.updated,
		DeleteFunc: s.removed}); err != nil {
		return nil, err
	}
	s.mu.Lock()
	s.informer = inf
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		defer close(done)
		inf.RunWithContext(ctx)
	}()
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			s.log.Info("watching the configuration through the API server")
			s.changes.Notify()
		}
		<-done
		s.changes.Stop()
	}()
	return s.changes.C(), nil
}

// added reports the object's creation, and its return after a deletion.
func (s *Source) added(any) {
	s.mu.Lock()
	was := s.deleted
	s.deleted = false
	s.mu.Unlock()
	if was {
		s.log.Info("the configuration's object exists again; the configuration follows it again")
	}
	s.changes.Notify()
}

// updated reports an edit of the object that changes its configuration; one that does not
// (labels, annotations, status) is not a change.
func (s *Source) updated(old, obj any) {
	before, revOld, errOld := s.document(old)
	after, revNew, errNew := s.document(obj)
	if errOld == nil && errNew == nil && bytes.Equal(before, after) && revOld.Generation == revNew.Generation {
		return
	}
	s.changes.Notify()
}

// removed reports the object's deletion, which is not an instruction: the configuration in
// force stays.
func (s *Source) removed(any) {
	s.mu.Lock()
	s.deleted = true
	s.mu.Unlock()
	s.log.Warn("the configuration's object was deleted; the configuration in force stays until it is created again",
		"defaults", "a deletion is not an instruction: create the object with an empty configuration to apply them")
	s.changes.Notify()
}

// Deleted implements config.Deletable.
func (s *Source) Deleted() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deleted
}

// answered records what a request to the API server found: an answer (err nil, or the
// server's own word that a watch's version is too old, which a relist mends), or why there was
// none. A loss is logged once, with what it calls for, and again when its reason changes; the
// server's return once.
func (s *Source) answered(err error) {
	if err != nil && (apierrors.IsResourceExpired(err) || apierrors.IsGone(err)) {
		err = nil
	}
	s.mu.Lock()
	was := s.lost
	s.lost = err
	s.mu.Unlock()
	switch {
	case err == nil && was == nil:
		return
	case err == nil:
		s.log.Info("the API server answers again; the configuration follows the object again", "was", was.Error())
	case was != nil && apierrors.ReasonForError(err) == apierrors.ReasonForError(was):
		return // the same trouble
	default:
		attrs := []any{"error", err}
		if apierrors.IsForbidden(err) {
			attrs = append(attrs, "need", s.obj.permission())
		}
		s.log.Warn("cannot read the configuration from the API server; the configuration in force stays until it answers", attrs...)
	}
	s.changes.Notify()
}

// Unreachable implements config.Reachable.
func (s *Source) Unreachable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lost
}

// Revision implements config.Revisioned.
func (s *Source) Revision() config.Revision {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.revision
}

// Load implements config.Source: the object as the informer last saw it. No object at the start
// means the defaults, as a missing file does; a deleted object means nothing to load
// (config.ErrUnavailable), so that the configuration in force stays; before the first list there
// is nothing to load yet.
func (s *Source) Load() (config.Config, error) {
	s.mu.Lock()
	inf, lost := s.informer, s.lost
	s.mu.Unlock()
	if inf == nil || !inf.HasSynced() {
		why := "waiting for the API server's first answer"
		if lost != nil {
			why = "the API server does not answer: " + lost.Error()
			if apierrors.IsForbidden(lost) {
				why += "; the agent needs " + s.obj.permission()
			}
		}
		return config.Config{}, fmt.Errorf("%s: %w: %s", s.obj, config.ErrUnavailable, why)
	}
	key := s.obj.Name
	if s.obj.Namespace != "" {
		key = s.obj.Namespace + "/" + key
	}
	item, exists, err := inf.GetStore().GetByKey(key)
	if err != nil {
		return config.Config{}, fmt.Errorf("%s: %w", s.obj, err)
	}
	var doc []byte
	var rev config.Revision
	var objGen int64
	if exists {
		objGen = item.(*unstructured.Unstructured).GetGeneration()
		if doc, rev, err = s.document(item); err != nil {
			return config.Config{}, fmt.Errorf("%s: %w", s.obj, err)
		}
	}
	s.mu.Lock()
	// Deleted: the handler said so, or it has yet to (the store changes first), and a Load read
	// the object before.
	if !exists && (s.deleted || s.revision.ResourceVersion != "") {
		s.mu.Unlock()
		return config.Config{}, fmt.Errorf("%s: %w: the object was deleted; the configuration in force stays until it is created again",
			s.obj, config.ErrUnavailable)
	}
	if !exists || s.revision.ResourceVersion == "" || !bytes.Equal(doc, s.doc) || rev.Generation != s.revision.Generation {
		s.revision, s.doc = rev, doc
	}
	held := rev.Generation != objGen && s.held != objGen
	if held {
		s.held = objGen
	}
	s.mu.Unlock()
	if held {
		s.log.Info("a new generation of the configuration is rolled out in waves; this node keeps the stable one until its wave",
			"generation", objGen, "applying", rev.Generation)
	}
	if doc == nil {
		return config.Default(s.opts.Config), nil
	}
	cfg, err := config.Parse(doc, s.opts.Config)
	if err != nil {
		return config.Config{}, fmt.Errorf("%s: %w", s.obj, err)
	}
	return cfg, nil
}

// configMaps are the core API's ConfigMaps.
var configMaps = schema.GroupVersionResource{Version: "v1", Resource: "configmaps"}

// document returns the configuration an object holds for this node, nil for none (the
// defaults): a ConfigMap's ConfigMapKey; an IPMasqAgentConfig's spec, or the stable spec its
// rollout keeps for the nodes it has not released yet (rollout.Pick). The revision is the
// object's, with the generation of the spec returned.
func (s *Source) document(item any) ([]byte, config.Revision, error) {
	o, ok := item.(*unstructured.Unstructured)
	if !ok {
		return nil, config.Revision{}, fmt.Errorf("not an API object but a %T", item)
	}
	rev := config.Revision{ResourceVersion: o.GetResourceVersion(), Generation: o.GetGeneration()}
	if s.obj.Kind == KindConfigMap {
		rev.Generation = 0 // a ConfigMap has none
		data, found, err := unstructured.NestedString(o.Object, "data", kube.ConfigMapKey)
		if err != nil || !found {
			return nil, rev, err
		}
		return []byte(data), rev, nil
	}
	ro, err := rollout.ObjectOf(o)
	if err != nil {
		return nil, rev, err
	}
	spec, gen := rollout.Pick(ro.Spec, ro.Generation, ro.Rollout, s.opts.Node)
	rev.Generation = gen
	if len(spec) == 0 || string(spec) == "null" {
		return nil, rev, nil
	}
	return spec, rev, nil
}
