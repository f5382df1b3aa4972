{{- define "stowaway.name" -}}{{ .Release.Name }}-stowaway{{- end -}}
{{- define "stowaway.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{- end -}}
{{- define "stowaway.tlsSecret" -}}{{ include "stowaway.name" . }}-webhook-tls{{- end -}}
{{- define "stowaway.labels" -}}
app.kubernetes.io/name: stowaway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}
{{- define "stowaway.selector" -}}
app.kubernetes.io/name: stowaway
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
