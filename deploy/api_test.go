package deploy

import (
	"encoding/json"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"

	"github.com/ip-masq-agent/ip-masq-agent/pkg/config"
	"github.com/ip-masq-agent/ip-masq-agent/pkg/kube"
)

// keyNames are config.Keys' names, in order.
func keyNames() []string {
	var out []string
	for _, k := range config.Keys {
		out = append(out, k.Name)
	}
	return out
}

// The admission policies know the agent's keys, in its order, and nothing else: their list is
// config.Keys.
func TestAdmissionPoliciesKnowTheKeys(t *testing.T) {
	all := manifests(t)
	quoted := regexp.MustCompile(`'([A-Za-z0-9]+)'`)
	for _, path := range []string{"admission/configmap.yaml", "admission/ipmasqagentconfig.yaml"} {
		p, ok := all[path][0].(*admissionregistrationv1.ValidatingAdmissionPolicy)
		if !ok {
			t.Fatalf("%s: %T", path, all[path][0])
		}
		i := slices.IndexFunc(p.Spec.Variables, func(v admissionregistrationv1.Variable) bool { return v.Name == "known" })
		if i < 0 {
			t.Fatalf("%s: no variable known", path)
		}
		var got []string
		for _, m := range quoted.FindAllStringSubmatch(p.Spec.Variables[i].Expression, -1) {
			got = append(got, m[1])
		}
		if !slices.Equal(got, keyNames()) {
			t.Errorf("%s knows %q, the agent %q", path, got, keyNames())
		}
		if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionregistrationv1.Ignore {
			t.Errorf("%s: failurePolicy %v, want Ignore: the agent judges what the policy cannot", path, p.Spec.FailurePolicy)
		}
	}
}

// The IPMasqAgentConfig's schema has a property for each key, of the key's type, and keeps
// unknown keys for the policy and the agent to refuse by name.
func TestConfigCRDIsTheKeys(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentconfigs.yaml")
	if crd.Name != kube.Configs.CRDName() || crd.Spec.Names.Kind != kube.Configs.Kind || crd.Spec.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("CRD %s of %s, %s; want %s of %s, cluster-scoped", crd.Name, crd.Spec.Names.Kind, crd.Spec.Scope, kube.Configs.CRDName(), kube.Configs.Kind)
	}
	spec := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
	if spec.XPreserveUnknownFields == nil || !*spec.XPreserveUnknownFields {
		t.Error("spec drops unknown keys: the agent would never see a misspelt one")
	}
	types := map[string]string{"list of CIDRs": "array", "list of CIDRs or `{cidr, address}`": "array", "bool": "boolean",
		"int": "integer", "duration": "string", "address": "string"}
	for _, k := range config.Keys {
		prop, ok := spec.Properties[k.Name]
		if !ok {
			t.Errorf("no property %s", k.Name)
			continue
		}
		if want := types[k.Type()]; prop.Type != want {
			t.Errorf("%s is of type %q, a %s wants %q", k.Name, prop.Type, k.Type(), want)
		}
	}
	if len(spec.Properties) != len(config.Keys) {
		t.Errorf("%d properties for %d keys", len(spec.Properties), len(config.Keys))
	}
}

// The IPMasqAgentNode's schema describes kube.NodeStatus, field for field: what the agent writes
// is what the schema keeps (the API server prunes the rest).
func TestNodeCRDIsTheStatus(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentnodes.yaml")
	if crd.Name != kube.Nodes.CRDName() || crd.Spec.Names.Kind != kube.Nodes.Kind || crd.Spec.Scope != apiextensionsv1.ClusterScoped {
		t.Errorf("CRD %s of %s, %s", crd.Name, crd.Spec.Names.Kind, crd.Spec.Scope)
	}
	status := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"]
	checkSchema(t, "status", reflect.TypeFor[kube.NodeStatus](), status)
	for _, c := range crd.Spec.Versions[0].AdditionalPrinterColumns {
		if !strings.HasPrefix(c.JSONPath, ".status.") && !strings.HasPrefix(c.JSONPath, ".metadata.") {
			t.Errorf("column %s shows %s", c.Name, c.JSONPath)
		}
	}
}

// The IPMasqAgentConfig's status schema is the rollout controller's kube.ConfigObjectStatus.
func TestConfigCRDStatusIsTheRollout(t *testing.T) {
	crd := one[*apiextensionsv1.CustomResourceDefinition](t, manifests(t), "crds/ipmasqagentconfigs.yaml")
	status := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["status"]
	checkSchema(t, "status", reflect.TypeFor[kube.ConfigObjectStatus](), status)
}

// checkSchema compares a Go type's JSON fields with an object schema's properties, recursively.
func checkSchema(t *testing.T, path string, typ reflect.Type, s apiextensionsv1.JSONSchemaProps) {
	t.Helper()
	if typ == reflect.TypeFor[json.RawMessage]() {
		return // any JSON: the schema says which
	}
	for typ.Kind() == reflect.Pointer || typ.Kind() == reflect.Slice {
		if typ.Kind() == reflect.Slice {
			if s.Items == nil || s.Items.Schema == nil {
				t.Errorf("%s: a list without items", path)
				return
			}
			s = *s.Items.Schema
		}
		typ = typ.Elem()
	}
	if typ.Kind() != reflect.Struct || typ.PkgPath() != reflect.TypeFor[kube.NodeStatus]().PkgPath() {
		return // a leaf, or metav1.Condition (the schema has its fields)
	}
	seen := map[string]bool{}
	for f := range typ.Fields() {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		seen[name] = true
		prop, ok := s.Properties[name]
		if !ok {
			t.Errorf("%s: the schema has no %s", path, name)
			continue
		}
		checkSchema(t, path+"."+name, f.Type, prop)
	}
	for name := range s.Properties {
		if !seen[name] {
			t.Errorf("%s: the schema has %s, which the agent does not write", path, name)
		}
	}
}

// Both CRDs have the status subresource: the agent writes a node's status through it (and
// RBAC grants it there), and an IPMasqAgentConfig's generation counts its spec's changes only.
func TestCRDsHaveStatusSubresource(t *testing.T) {
	all := manifests(t)
	for _, path := range []string{"crds/ipmasqagentconfigs.yaml", "crds/ipmasqagentnodes.yaml"} {
		crd := one[*apiextensionsv1.CustomResourceDefinition](t, all, path)
		for _, v := range crd.Spec.Versions {
			if v.Subresources == nil || v.Subresources.Status == nil {
				t.Errorf("%s %s: no status subresource", path, v.Name)
			}
		}
	}
}

// Least privilege: each source's role reads its one object, the status role writes node statuses
// and reads Nodes, and nothing more.
func TestRBACIsLeast(t *testing.T) {
	all := manifests(t)
	rule := func(groups, resources, names, verbs []string) rbacv1.PolicyRule {
		return rbacv1.PolicyRule{APIGroups: groups, Resources: resources, ResourceNames: names, Verbs: verbs}
	}
	read := []string{"get", "list", "watch"}
	for path, want := range map[string][]rbacv1.PolicyRule{
		"rbac/configmap/role.yaml":  {rule([]string{""}, []string{"configmaps"}, []string{kube.DefaultConfigMapName}, read)},
		"rbac/crd/clusterrole.yaml": {rule([]string{kube.Group}, []string{kube.Configs.Plural}, []string{kube.DefaultConfigName}, read)},
		"rbac/status/clusterrole.yaml": {rule([]string{kube.Group}, []string{kube.Nodes.Plural}, nil, []string{"create", "patch"}),
			rule([]string{kube.Group}, []string{kube.Nodes.Plural + "/status"}, nil, []string{"patch"}), rule([]string{""}, []string{"nodes"}, nil, []string{"get"})},
		// --metrics-secure: the agent asks about its scrapers; a scraper gets /metrics.
		"rbac/metrics/clusterrole.yaml": {rule([]string{"authentication.k8s.io"}, []string{"tokenreviews"}, nil, []string{"create"}),
			rule([]string{"authorization.k8s.io"}, []string{"subjectaccessreviews"}, nil, []string{"create"})},
		"rbac/metrics/reader.yaml": {{NonResourceURLs: []string{"/metrics"}, Verbs: []string{"get"}}},
		// The rollout controller reads the object and writes its status, and reads the nodes'.
		"rbac/rollout/clusterrole.yaml": {
			rule([]string{kube.Group}, []string{kube.Configs.Plural}, []string{kube.DefaultConfigName}, []string{"get", "list", "watch", "patch"}),
			rule([]string{kube.Group}, []string{kube.Configs.Plural + "/status"}, []string{kube.DefaultConfigName}, []string{"update"}),
			rule([]string{kube.Group}, []string{kube.Nodes.Plural}, nil, read)},
	} {
		var got []rbacv1.PolicyRule
		switch r := all[path][0].(type) {
		case *rbacv1.Role:
			got = r.Rules
		case *rbacv1.ClusterRole:
			got = r.Rules
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s grants %+v, want %+v", path, got, want)
		}
	}
}
